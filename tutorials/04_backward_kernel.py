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
#   instead of stored, and how a gradient through `lse` enters as a shifted D;
# - the paper's backward roofline: why shared memory, not the tensor cores, bounds it, and how
#   the 2-CTA mode (two SMs sharing one MMA) relieves it by exchanging half of dS through
#   distributed shared memory, down to the instruction that does it;
# - how the Blackwell backward fits its accumulators into 512 columns of tensor memory;
# - how the deterministic mode orders the dQ reduction, and why that order is shortest-first;
# - how to read a compiled backward: the dQ reduction and its semaphores in the SASS, serialized
#   wgmmas, and the exponentials that run under the dP wgmma.
#
# **The idea, in the paper's words** (§3.2, *Attention backward pass*): "The backward pass
# performs five matrix multiply-accumulate (MMA) operations per iteration ... The shared memory
# traffic time of 3328 cycles exceeds both the MMA compute time (2560 cycles) and the exponential
# unit time (1024 cycles), indicating that shared memory bandwidth is the primary bottleneck."
# And (§3.2.3): "we use distributed shared memory (DSMEM) to exchange half of the dS between the
# two CTAs since they are in the same cluster."
#
# **Code path**: `stage0_reference/reference.py` (`attention_backward`, the oracle),
# `stage1_online_softmax/flash.py` (`flash_backward`, tiled), `stage4_bwd_kernel/` — `roofline.py`,
# `schedule.py` + `model.py` (the kernel's walk and semaphores, replayed on the CPU), the Hopper
# lessons `hopper_step1.py` → `hopper_step2_warpspec.py` → `hopper_step3_rs.py`, the production
# kernel `stage4_bwd_kernel.hopper`, and the Blackwell kernels `blackwell_bwd.py` (1-CTA),
# `blackwell_bwd_wide.py` ((192, 128) and 256) and `blackwell_bwd_2cta.py` (2-CTA) with their plan in
# `blackwell_config.py`; `stage5_scheduling/orders.py`
# (`spt_bwd`, `dq_rank`).
#
# **Status**: the Hopper lessons and the production backward (`stage4_bwd_kernel.hopper`: its
# composed kernel serves every head dim, (192, 128) and 256 on its wide designs, `hopper/wide_swap.py`
# and `hopper/wide.py`) pass
# their GPU tests on Hopper, the deterministic mode included; their speed is read below from
# committed H100 results. On a CPU-only machine the notebook compiles them for `sm_90a`. The Blackwell
# backward kernels are compiled for `sm_100a` in the tests and have **never run on hardware**: the
# TMEM plan and the 2-CTA exchange below are drawn from the paper's text, and the kernels follow them.

# %%
import re
from collections import Counter

import matplotlib.pyplot as plt
import numpy as np

from stage0_reference import attention_backward, attention_forward
from stage1_online_softmax import flash_backward
from stage4_bwd_kernel import model as s4_model
from stage4_bwd_kernel import roofline as s4_roofline
from stage4_bwd_kernel import schedule as s4_schedule

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
# ### A gradient through `lse`: one more term in D
# A model may use `lse` itself (context-parallel attention merges partial results through it), so
# a loss can reach it too. Since `lse_i = log sum_j exp(scale S_ij)`, its derivative is
# `d lse_i / d (scale S_ij) = P_ij`, and a gradient `dlse_i` adds `P_ij dlse_i` to dS:
# `dS = P * (dP - D) + P * dlse = P * (dP - (D - dlse))`. So it costs no sixth MMA, only a shifted
# D: the product backward's preprocess stores `D - dlse` (`stage4_bwd_kernel/preprocess.py`).
# Below, the shifted D against stage 0 and against a finite difference of the loss
# `sum(out * dout) + sum(lse * dlse)`.

# %%
dlse = rng.standard_normal(M)                     # (M,): one value per query row
dq_ref, dk_ref, dv_ref = attention_backward(q, k, v, out, dout, lse, dlse=dlse[None, None, :])
dS_lse = P * (dP - (D - dlse[:, None]))           # the only change: D - dlse
for name, mine, ref in (("dq", scale * dS_lse @ K, dq_ref), ("dk", scale * dS_lse.T @ Q, dk_ref), ("dv", dV, dv_ref)):
    err = np.abs(mine - ref[0, :, 0]).max()
    print(f"{name} with dlse: max |shifted D - stage 0| = {err:.1e}")
    assert err < 1e-12


def loss_of(q_):
    o, l = attention_forward(q_, k, v)
    return (o * dout).sum() + (l[0, 0] * dlse).sum()


step = 1e-6
bump = np.zeros_like(q)
bump[0, 3, 0, 5] = step
finite_difference = (loss_of(q + bump) - loss_of(q - bump)) / (2 * step)
print(f"dq[3, 5]: shifted D {scale * (dS_lse @ K)[3, 5]:+.8f}, finite difference {finite_difference:+.8f}")
assert abs(scale * (dS_lse @ K)[3, 5] - finite_difference) < 1e-6

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
# On an H100 (half the tensor-core rate, the same 128 B/clk of SMEM) step 1 of the Hopper ladder
# keeps every operand in shared memory and is SMEM-bound the same way; step 3 keeps `P^T` and `dS^T`
# in registers (FA3's layout, `fa3_rs`), which makes the tile MMA-bound, at the price of the
# accumulator registers a warp-specialized kernel has to find.
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
steady = {d: bp.per_tile_clocks(d) for d in (64, 128)}  # clocks per Q tile in steady state: the titles and the print
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
    clk, tc_busy = steady[128][label]
    ax.set_title(f"{label}: {clk:.0f} clk per Q tile in steady state, tensor cores busy {tc_busy:.0%} "
                 f"(the first 4 tiles drawn)", fontsize=8)
axes[-1].set_xlabel("B200 clocks (model: 512 per 128x128x128 MMA, 1152 for P's exponentials)")
plt.tight_layout()
plt.show()
for d in (64, 128):
    for label, (clk, tc) in steady[d].items():
        print(f"d={d:3}  {label:42} {clk:5.0f} clk / Q tile, tensor cores busy {tc:.0%}")

# %% [markdown]
# ## Blackwell at (192, 128) and 256: when the tile does not fit tensor memory
# The plan above fills all 512 columns at d = 128. At (192, 128) the same 128 x 128 tile needs
# S 128 + dV 128 + dP 128 + dK 192 = 576 columns before dQ has anywhere to go, and at 256 dK and dV alone
# take 512. `blackwell_bwd_wide.py` (compiled for sm_100a, never run) makes three changes: a 64-query
# tile (S^T and dP^T shrink to 64 columns), dQ computed transposed, `dQ^T = K^T dS^T`, so the drain's
# thread r owns head-dim column r (128-row windows of the K tile, overlapping at 192), and at 256 two
# CTAs per K/V tile, each owning half of dK, dV and dQ's columns. The price is the pipeline: the cell
# prints the plans and the roofline's estimate (B200 cycles per 1k key-query pairs).

# %%
try:
    bw_cfg.blackwell_bwd_config(192, 128, "bf16", causal=False)
except ValueError as e:
    print("1-CTA plan at (192, 128):", str(e).split(";")[0])
for d, dv in bw_cfg.SUPPORTED_HEAD_DIMS_WIDE:
    wide = bw_cfg.blackwell_bwd_wide_config(d, dv, "bf16", causal=False)
    print(f"\n{wide.summary()}\n{wide.tmem.table()}")
from stage4_bwd_kernel import roofline as bwd_roofline  # noqa: E402

print("\n" + bwd_roofline.blackwell_wide_table())

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
# the roofline charges the exchange as three passes over these bytes
assert sent * 3 / B200.smem_bytes_per_clock == two.smem_ds_exchange


# %% [markdown]
# ### The exchange in the kernel
# In `blackwell_bwd_2cta.py` the exchange is four steps of the elementwise warpgroup, per Q tile:
# 1. each thread (one key) writes its dS row in two halves: the query rows this CTA keeps go to its own
#    `sdS`, the rows the peer owns to a staging buffer `sXchg`;
# 2. `fence.proxy.async` makes those ordinary stores visible to the async proxy, which both the MMA and
#    the bulk copy read through, and a named barrier waits for all 128 threads;
# 3. one thread tells the *peer's* `xchg_full` mbarrier how many bytes to expect
#    (`mbarrier_arrive_and_expect_tx(..., peer)`, a remote arrive in the cluster), and
# 4. issues one `cp.async.bulk.shared::cluster` from `sXchg` into the peer's `sdS`, at the column offset
#    of this CTA's keys. The copy completes its bytes on the peer's `xchg_full`, so the peer's MMA may
#    read them once that phase completes; no thread of the peer spins on the data.
#
# The copy itself is `common.bulk_copy_to_peer`: `mapa` translates this CTA's shared-memory addresses
# of the destination and of the mbarrier into the peer's window of the cluster's shared memory.

# %%
import ast
import pathlib

from stage4_bwd_kernel import blackwell_bwd_2cta
from stage4_bwd_kernel import common as s4_common


def source_lines(module, qualname):
    """(first line number, source lines) of `Class.method` or `function` in a module, read with ast."""
    path = pathlib.Path(module.__file__)
    text = path.read_text()
    node = None
    for part in qualname.split("."):
        node = next(n for n in (ast.parse(text) if node is None else node).body if getattr(n, "name", None) == part)
    first = node.decorator_list[0].lineno if node.decorator_list else node.lineno
    return first, text.splitlines()[first - 1:node.end_lineno]


def owner(module, method):
    """The name of the class in `module` that defines `method`."""
    return next(n for n, c in vars(module).items() if isinstance(c, type) and method in vars(c))


print("\n".join(source_lines(s4_common, "bulk_copy_to_peer")[1]), "\n")
# the exchange inside the elementwise warpgroup: from the split of the dS row to the bulk copy
first, body = source_lines(blackwell_bwd_2cta, owner(blackwell_bwd_2cta, "elementwise_pair") + ".elementwise_pair")
lo = next(i for i, line in enumerate(body) if "autovec_copy" in line) - 2
hi = next(i for i, line in enumerate(body) if "bulk_copy_to_peer" in line) + 2
print(f"blackwell_bwd_2cta.py, lines {first + lo}-{first + hi}:")
print("\n".join(body[lo:hi + 1]))
assert "mapa.shared::cluster" in "\n".join(source_lines(s4_common, "bulk_copy_to_peer")[1])

# %% [markdown]
# On the receiving side the MMA thread of the even CTA waits for three things before it issues
# `dQ = dS K` for the pair: its own warpgroup's rows (`ds_full`), the peer's rows landed in its `sdS`
# (`xchg_full`), and the news that the even CTA's rows have landed in the odd CTA (`xchg_peer`), which
# a relay warp of the odd CTA forwards because one thread issues the MMAs of both CTAs:

# %%
for name in ("_wait_ds", "relay"):
    print("\n".join(source_lines(blackwell_bwd_2cta, f"{owner(blackwell_bwd_2cta, name)}.{name}")[1]), "\n")

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
# The simulation above counts an add as seen the moment it happens. On a GPU it is not: the writer
# warp acquires the semaphore, issues the TMA reduce-add, waits for it to *land* in L2, fences and
# releases, and only then can the next CTA's spin see its turn -- a few microseconds, about a tile's
# worth of math at d = 64. Give every add that delay (`hop=1`) and a cost appears that no reduction
# order removes: the CTAs of one (kv head, batch) -- a *chain* -- launched side by side with
# `blockIdx.x = n`, reach every dQ tile together, and the k-th of them waits k hops before its first
# add. Worse, the first CTAs of all chains in flight finish together and hand their SMs to the
# consecutive K/V tiles of the *next* chain, so each wave starts side by side again.
#
# `schedule.KVAscendingSectionsOrder` keeps the ranks and changes only which CTA a launch index
# gets: sections of G chains with the K/V tile outer, G = ceil(128 / num_n_blocks), so a section is
# about one wave. Tile n of a chain then launches G CTAs after tile n - 1 (still after it: no
# deadlock), and the stagger carries over from wave to wave. The bits do not change, only who waits.
# The simulation, non-causal 1k, 8 batches x 32 heads on 132 SM slots:


# %%
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
# ### Two warpgroups, one counter: the turns at head dim 256
#
# At 256 the writer warp's 64 KB dQ buffer would cost the second Q / dO stage, so the two consumer
# warpgroups add dQ from their own registers, each its half of the columns (a *share*). In
# deterministic mode each share must still receive the K/V tiles in rank order, but the warpgroups run
# apart. The tile's counter therefore counts warpgroups, not CTAs: rank r may add once it reads
# 2 r, i.e. once *both* warpgroups of every earlier CTA are done. Counting CTAs (r) would let a
# warpgroup overtake: with CTA 0's second warpgroup done and its first one late, the counter reads 1,
# and CTA 1's first warpgroup would add its share before CTA 0's. In the kernel two idle warps of the
# producer warpgroup keep these turns (spin, hand the turn over by a named barrier, release), so the
# math warps never spin themselves. The simulator, warpgroups drifting apart at random:

# %%
def overtakes(threshold):
    """CTA 0's warpgroup 1 has added, its warpgroup 0 is late: may CTA 1's warpgroup 0 add now?"""
    count, rank = 1, 1
    return count >= threshold(rank)

print("counting CTAs (>= r) lets CTA 1 overtake:", overtakes(lambda r: r),
      "| counting warpgroups (>= 2 r):", overtakes(lambda r: 2 * r))
sim = s4_model.simulate_semaphores(seqlen_q=1000, seqlen_k=1000, tile_m=64, tile_n=64, causal=True,
                                   order=s4_schedule.KVDescendingOrder, heads_kv=2, resident=16, warpgroups=2,
                                   jitter=0.3, seed=0)
in_order = all(seq == sorted(seq, reverse=True) for seq in sim.add_sequence.values())
print(f"{len(sim.add_sequence)} (tile, share) sequences, each in the order's sequence: {in_order}")
assert sim.finished and in_order and not overtakes(lambda r: 2 * r)


# %% [markdown]
# The same sections help the *default* mode too, under a causal mask, for a different reason: the
# grid's tail. Nothing waits there, but the walks are unequal (K/V tile n visits the Q tiles from
# its diagonal down, so n = 0 walks all of them and the last tile one or two). With
# `blockIdx.x = n` the last head's longest walk is launched only N CTAs before the grid's end and
# finishes alone; in sections of G heads the long walks of the last G heads start about a wave
# earlier. A greedy list schedule (each CTA to the first free SM, in launch order) of the walks on
# 132 SMs, d = 128's 80 x 128 tile, 32k tokens of 16 heads:

# %%
for seqlen in (2048, 4096, 8192, 16384):
    kw = dict(seqlen_q=seqlen, seqlen_k=seqlen, tile_m=80, tile_n=128, causal=True, batch=32768 // seqlen,
              heads_kv=16)
    plain = s4_model.default_mode_steps(order=s4_schedule.KVAscendingOrder, **kw)
    sections = s4_model.default_mode_steps(order=s4_schedule.KVAscendingSectionsOrder, **kw)
    print(f"causal {seqlen:>5}: blockIdx order {plain:>5} tile-steps, sections of "
          f"{-(-128 // (seqlen // 128)):>2} heads {sections:>5} ({1 - sections / plain:.1%} shorter)")

# %% [markdown]
# At 16k a section is one head, the blockIdx order itself. Paired rounds on an H100 favoured sections
# from 4k keys on and not below, which this model does not explain; on an H200 they gain at 2k too
# (+2% in paired rounds) and tie at 1k, so the production causal order (`KVAscendingSectionsOrder`)
# launches in sections at every length. The clock stamps behind that choice, at 2k on an H200
# (`python -m benchmarks.inspect.trace_bwd --dim 128 --causal --seqlen 2048 --batch 16 --heads 16
# --impls ours,stage4_bwd_kernel.hopper.backward:kv_ascending_sections,official`, run while the
# production kernel, "ours" in the file, still launched 2k in blockIdx order): the same work in
# every order (the sum of the CTAs' cycles), a different tail.

# %%
import json

# the committed results, found from the package's location: any working directory works
RESULTS = pathlib.Path(s4_model.__file__).resolve().parents[1] / "benchmarks" / "results"
trace_file = RESULTS / "trace_bwd_h200_causal2k_d128_sections.json"
order_names = {"ours": "blockIdx order", "stage4_bwd_kernel.hopper.backward:kv_ascending_sections": "sections",
               "official": "official FA4"}
traced = {order_names[r["impl"]]: r for r in json.loads(trace_file.read_text())["results"]}
for name, r in traced.items():
    print(f"{name:>14}: kernel {r['span_us']:6.0f} us, the SMs' idle time at the end {r['idle_at_end_us_mean']:4.1f} us "
          f"mean ({r['idle_at_end_us_max']:4.1f} max), all CTAs {r['cta_cycles_sum'] / 1e6:5.1f} M cycles")
work = [r["cta_cycles_sum"] for r in traced.values()]
assert max(work) < 1.01 * min(work)  # the same work, within 1%
assert traced["sections"]["idle_at_end_us_mean"] < traced["blockIdx order"]["idle_at_end_us_mean"] / 2

# %% [markdown]
# What is left at 2k is each CTA's fixed cost. A causal walk at 2k is short (2 to 26 Q tiles), so what
# a CTA pays once -- its prologue (entry to the consumers' start), its first tile beyond a steady one
# (the loads' latency and a pipeline with nothing to overlap yet) and its dK / dV epilogue -- weighs
# against a few tiles only. The same traces with a stamp at every tile's end (`--tile-stamps`, medians
# over the CTAs), ours against the official kernel (per query row, a steady tile of ours is 3% cheaper at
# d = 128 and 2% dearer at d = 64):

# %%
fig, axes = plt.subplots(1, 2, figsize=(11, 3.0), sharex=True)
for ax, d in zip(axes, (128, 64)):
    rows = json.loads((RESULTS / f"trace_bwd_h200_causal2k_d{d}.json").read_text())["results"]
    names, parts = [], []
    for r in rows:
        names.append(f"{r['impl']}\n{r['cycles_per_query_row']:.1f} cycles a row")
        parts.append((r["prologue_cycles_median"], r["first_tile_cycles_median"] - r["later_tile_cycles_median"],
                      r["epilogue_cycles_median"]))
    left = np.zeros(len(rows))
    for k, label in enumerate(("prologue", "first tile beyond a steady one", "dK / dV epilogue")):
        widths = np.array([p[k] for p in parts])
        ax.barh(names, widths, left=left, label=label if ax is axes[0] else None)
        left += widths
    ax.set_title(f"d = {d}, causal, 2k: a CTA's fixed cycles")
    ax.set_xlabel("cycles")
fig.legend(loc="lower center", ncol=3, fontsize=8)
plt.tight_layout(rect=(0, 0.08, 1, 1))
plt.show()
fixed = {r["impl"]: r for r in rows}  # d = 64, the last drawn
assert fixed["ours"]["prologue_cycles_median"] > fixed["official"]["prologue_cycles_median"]

# %% [markdown]
# ## The Hopper ladder: three lessons
# Like the forward, the Hopper backward is taught in steps, each a whole kernel whose docstring says
# what it adds and why: step 1 puts the five GEMMs on wgmma with every operand in shared memory,
# step 2 specializes warps (a producer warp for the loads, consumer warpgroups for the math), and
# step 3 keeps P^T and dS^T in registers as the A operand of the dV and dK wgmmas (FA3's layout,
# `fa3_rs` in the roofline table above). The diff sizes, computed from the files:

# %%
import difflib

import stage4_bwd_kernel

S4 = pathlib.Path(stage4_bwd_kernel.__file__).resolve().parent
BWD_LADDER = ["hopper_step1", "hopper_step2_warpspec", "hopper_step3_rs"]


def code_lines(path):
    """The file's lines after its module docstring."""
    text = path.read_text()
    return text.splitlines()[ast.parse(text).body[0].end_lineno:]


print(f"{'step':<24}{'code lines':>11}{'+added':>8}{'-removed':>9}")
for prev, name in zip([None] + BWD_LADDER, BWD_LADDER):
    new = code_lines(S4 / f"{name}.py")
    added = removed = 0
    if prev:
        ops = difflib.SequenceMatcher(None, code_lines(S4 / f"{prev}.py"), new, autojunk=False).get_opcodes()
        added = sum(j2 - j1 for tag, i1, i2, j1, j2 in ops if tag in ("replace", "insert"))
        removed = sum(i2 - i1 for tag, i1, i2, j1, j2 in ops if tag in ("replace", "delete"))
        assert added <= 600, (name, added)  # a lesson is a diff a reader can hold
    print(f"{name:<24}{len(new):>11}{added:>8}{removed:>9}")

# %% [markdown]
# ## The production backward, compiled here (and run, on a GPU)
# `stage4_bwd_kernel.hopper` is the stable entry point that `fa4` calls; `step_for` says which kernel
# serves a configuration: the composed kernel for every head dim, on its wide designs at (192, 128) and
# 256, whose dK / dV would not fit a warpgroup's registers. It is composed from named components and
# carries the production work the lessons leave out (the sections below read some of it from the
# SASS). Compiled for `sm_90a` with fake tensors, with and without the deterministic mode: the dQ
# partial sums leave each tile through reduce-adds of the TMA unit into an fp32 buffer (`UBLKRED`, or
# `UTMAREDG` for a tensor tile). The deterministic kernel adds in a fixed order on a semaphore per tile: an
# acquire load to spin on (`LDG.E.STRONG.GPU`), a GPU-wide fence (`MEMBAR.ALL.GPU`) and the release add
# (`REDG.E.ADD.S32`). The default causal kernel uses the same three for *first stores*: nobody zeroes the
# buffer; each tile's first arriving K/V tile, counted by an atomic (`ATOMG`), stores its share (`UBLKCP`)
# and the others wait for that store to land before they reduce (`stage4_bwd_kernel/hopper/dq_writer.py`).
# On a Hopper GPU the cell also checks the gradients against fp32 autograd with FA4's rule.

# %%
from stage3_fwd_kernel import host_io, runner
from stage4_bwd_kernel import hopper as s4_hopper

for d in (64, 96, 128, 192, 256):
    serving = s4_hopper.step_for(d, False, False)
    print(f"head dim {d:>3}: {getattr(serving, 'STEP', serving.__name__)}")


def sass_counts(sass):
    ops = Counter(m.group(1) for m in re.finditer(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.x]+)", sass))
    pick = {"dQ bulk reduce (UBLKRED / UTMAREDG)": ("UBLKRED", "UTMAREDG"), "dQ atomics (REDG.F32)": "REDG.E.ADD.F32",
            "semaphore spin (LDG.STRONG.GPU)": "LDG.E.STRONG.GPU", "fence (MEMBAR.ALL.GPU)": "MEMBAR.ALL.GPU",
            "release (REDG.S32)": "REDG.E.ADD.S32", "arrival count (ATOMG)": "ATOMG",
            "first store (UBLKCP)": "UBLKCP"}
    return {label: sum(n for op, n in ops.items() if op.startswith(prefix)) for label, prefix in pick.items()}


builds = {}
print(f"\nbf16, d = 128, causal, {host_io.ARCH}")
for det in (False, True):
    builds[det] = s4_hopper.step_for(128, True, det).compile_only("bf16", 128, causal=True, deterministic=det)
    rep = builds[det].report
    print(f"  deterministic={det!s:<5}: threads {rep['threads']}, registers {rep['registers']}, spills "
          f"{rep['spill_stores']}, SMEM {rep['smem_bytes']} B, HGMMA {rep['HGMMA']}, MUFU.EX2 {rep['MUFU.EX2']}")
    print("      " + ", ".join(f"{k} {v}" for k, v in sass_counts(builds[det].sass).items()))
    assert rep["spill_stores"] == 0
counts = {det: sass_counts(builds[det].sass) for det in builds}
assert counts[True]["semaphore spin (LDG.STRONG.GPU)"] > 0 and counts[True]["first store (UBLKCP)"] == 0
assert counts[False]["first store (UBLKCP)"] > 0 and counts[False]["arrival count (ATOMG)"] > 0

if runner.hopper_gpu_available():
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
# ## Persistent CTAs: four roles, two rings, and a model of their hand-offs
# On short calls a CTA per K/V tile spends a visible share of its life starting and ending: barrier
# set-up, the wait for its first K, V, Q and dO, and a dK / dV epilogue with nothing else in flight.
# `stage4_bwd_kernel/hopper/persistent.py` keeps one CTA per SM instead; each takes the next K/V tile
# (an "item") from a global counter, so the next item's loads run under the current epilogue.
# `attention_backward` takes it for d = 128 calls of at most 2k keys and (128, 64) calls of at most 1k
# (queries x GQA group within the same limit), where it measured faster on an H200
# (`backward.persistent_pays`).
#
# The price is the hand-offs. Four roles share the CTA: the producer warp (TMA loads), the dQ writer warp
# and two consumer warpgroups. The producer publishes each item's index in a two-slot ring that every
# consumer thread reads, and writes a record of each walk (where its dQ tiles go) into a four-slot ring
# that the writer reads. Each slot is guarded by mbarriers, whose waits name a *phase parity*
# (`try_wait.parity`), not a phase number: a wait cannot tell phase i from phase i + 2.
#
# `stage4_bwd_kernel/persistent_protocol.py` models the roles as Python generators over the kernel's
# mbarriers (phases, parities, arrival counts) and named barriers (thread counts), and runs them under
# random schedules and random item lists. It checks that nothing deadlocks, no named barrier is left
# half-filled at exit, no slot is overwritten before its readers read it, and no mbarrier phase completes
# without anyone waiting for it before the next one starts (compute-sanitizer's synccheck calls that a
# "Missing wait"). Below: the kernel's protocol passes, and three bugs planted in it are caught. The
# first two were real: a review found the producer waiting for item i - 2's readers (the parity of i - 2
# is the parity of i: a hang), and synccheck on an H200 found item 0's phase never waited for.

# %%
from stage4_bwd_kernel import persistent_protocol as proto

print(f"the kernel's hand-offs: {proto.check(200, seed=5)} random item lists x dQ buffers (1, 2) x dS^T "
      "buffers (1, 2), each under a random schedule: no failure")
planted = {
    "wait for item i - 2's readers (parity aliasing)": dict(wait_parity_lag=2, missing_waits=True),
    "item 1 published without waiting for item 0's readers": dict(first_items_wait=2),
    "consumers' end-of-CTA dQ syncs dropped": dict(end_syncs=False),
}
for what, plant in planted.items():
    try:
        proto.check(200, seed=5, **plant)
        raise AssertionError(f"{what}: not caught")
    except proto.ProtocolError as err:
        print(f"- {what}:\n    {str(err)[:110]}")

# %% [markdown]
# What the model cannot see: the compiled code. compute-sanitizer's racecheck also reported a
# write-after-read hazard on the item ring that no schedule of the model has. The SASS explained it: the
# writer's read of record 0 (five 32-bit words) compiled to a 16-byte `LDS.128` that started one word
# early, on the item ring's second slot, which the producer stores when it publishes item 1. The value
# was thrown away, but the read raced the store. The fix is in the layout, not the protocol: each ring
# slot now owns its 16-byte chunks (a record is 8 words), so a vector load stays inside its slot.

# %% [markdown]
# ## Wide head dims: when dK and dV do not fit the registers
# The production kernel keeps each consumer warpgroup's 64 keys of dK and dV in registers for the whole
# walk: `64 d / 128 + 64 dv / 128` floats a thread, beside S^T, dP^T and the 16-bit P^T. At (192, 128)
# and 256 that no longer fits the 240 registers `setmaxnreg` gives a consumer, so those dims share
# keys between the two warpgroups. At 256 (`stage4_bwd_kernel/hopper/wide.py`): both on the *same* 64
# keys, S^T / dP^T split by queries, P^T / dS^T through shared memory, dV / dK split by columns. At
# (192, 128) (`hopper/wide_swap.py`): 96 keys a CTA -- no wgmma M, so the keys go on N -- with S / dP
# split by keys (48 each), P / dS through shared memory and dK^T / dV^T holding the head dim as M;
# each Q / dO load and each dQ tile's trip through shared memory then serves 1.5x the work, which
# measured 1.12-1.19x faster on an H200. The cell counts the registers of the designs, then the shared
# memory that decided the 256 plan: a 64 KB fp32 dQ buffer leaves room for one Q / dO stage only, so
# at 256 the consumers add dQ themselves (16-byte `red.global.add.v4.f32`) and keep two stages --
# measured 1.08-1.15x of the official kernel on an H200, against 0.75-0.81x with the buffer and one
# stage (`docs/measurements.md`). Deterministic mode adds the same way, each CTA's warpgroups in their
# turns on the dQ tile's semaphore; two idle warps keep the turns (spin, then release), so the spin and the release's
# fence are off the math warps: 0.89-0.96x of the default's speed on an H200.

# %%
from stage3_fwd_kernel.host_io import SMEM_BUDGET
from stage4_bwd_kernel.hopper.options import BackwardOptions, smem_need

print(f"{'head dims':>11} | {'register-sourced (regs)':>23} | {'64 keys (regs)':>14} | {'96 keys (regs)':>14}")
for d, dv in ((128, 128), (192, 128), (256, 256)):
    rs = 64 * d // 128 + 64 * dv // 128 + 32 + 32 + 16        # dK + dV + S^T + dP^T + 16-bit P^T
    wide = s4_roofline.wide_registers("exchange_dims", 64, d, dv)["total"]
    swap = s4_roofline.wide_registers("swap_keys", 64, d, dv, 96)["total"]
    print(f"{str((d, dv)):>11} | {rs:>23} | {wide:>14.0f} | {swap:>14.0f}")
assert 64 * 192 // 128 + 64 * 128 // 128 + 80 == 240  # (192, 128): every register, before addresses
assert s4_roofline.wide_registers("swap_keys", 64, 192, 128, 96)["total"] == 168  # dK^T 72 + dV^T 48 + 48

kb = lambda b: f"{b / 1024:.0f} KB"  # noqa: E731
for stages, dq in ((1, 1), (2, 1), (2, 0)):
    need = smem_need(64, 64, 256, 256, 1, dq, stages, pt_buffers=1)
    print(f"256: {stages} Q/dO stage(s), {dq} dQ buffer(s): {kb(need)} of {kb(SMEM_BUDGET)}"
          f"{'' if need <= SMEM_BUDGET else '  -- does not fit'}")
plan = BackwardOptions.for_config(256, 256, causal=True, deterministic=False, varlen=False)
assert (plan.stages, plan.dq_atomic) == (2, True)
det_plan = BackwardOptions.for_config(256, 256, True, True, False)  # deterministic: the same reds, in turns
assert (det_plan.stages, det_plan.dq_atomic) == (2, True)

# %% [markdown]
# Why 96 keys at (192, 128): every design here is bound by shared memory once the fp32 dQ tile's trip
# through it is counted (8 m d bytes a tile: written by the consumers, read by the writer warp's bulk
# reduce), and that trip costs the same whatever the tile's keys. The model's cycles per 1024
# key-query pairs put the designs on one scale: 96 keys pay 0.87x of what 64 keys pay, and the kernel
# measured 1.12-1.19x faster on an H200 (the stage 4 README has the whole table and the runs).

# %%
for design, keys in (("exchange_dims", 64), ("swap_keys", 96)):
    c = s4_roofline.wide_tile_cycles(design, 64, 192, 128, keys)
    print(f"{design:>13} 64 x {keys}: SMEM {c.smem:5.0f} cycles a tile (dQ staging {c.smem_dq:.0f}), "
          f"MMA {c.mma:5.0f}, {c.smem * 1024 / (64 * keys):.0f} SMEM cycles per 1k pairs")
per_pair = [s4_roofline.wide_tile_cycles(dsg, 64, 192, 128, n).smem / n for dsg, n in (("swap_keys", 96),
                                                                                    ("exchange_dims", 64))]
assert per_pair[0] < 0.9 * per_pair[1]

# %% [markdown]
# ## Measured on an H100
# `benchmarks/bench_bwd.py` times our backward (default and deterministic) against the official FA4
# and cuDNN in one run and writes `benchmarks/results/bwd_h100*.json`; the newest committed run is
# plotted. One panel per head dim and mask, TFLOP/s against the sequence length (32k tokens per
# batch). In these files the production kernel is named after the ladder step it was built in.

# %%
def run_number(path):  # "run10" sorts after "run9"
    return int(re.search(r"_run(\d+)", path.name).group(1))


newest = sorted(RESULTS.glob("bwd_h100_run*.json"), key=run_number)[-1]
doc = json.loads(newest.read_text())
print(f"{newest.name}: {doc['device']}, commit {doc.get('git_commit')}\n    {doc['command']}")
rows = [r for r in doc["results"] if r.get("tflops")]
tf = {(r["impl"], r["head_dim"], r["causal"], r["seqlen"]): r["tflops"] for r in rows}
impls = list(dict.fromkeys(r["impl"] for r in rows))
label = {i: i.replace("ours:step3_rs", "ours").replace(" deterministic", ", deterministic") for i in impls}
dims, seqlens = sorted({r["head_dim"] for r in rows}), sorted({r["seqlen"] for r in rows})
fig, axes = plt.subplots(2, len(dims), figsize=(3.6 * len(dims), 5.8), sharex=True, sharey=True, squeeze=False)
styles = {impl: style for impl, style in zip(impls, ["C3o-", "C3s--", "ko-", "k^:"])}
for col, d in enumerate(dims):
    for row, causal in enumerate((False, True)):
        ax = axes[row, col]
        for impl in impls:
            pts = [(s, tf[(impl, d, causal, s)]) for s in seqlens if (impl, d, causal, s) in tf]
            ax.plot(*zip(*pts), styles.get(impl, "o-"), label=label[impl], ms=4)
        ax.set_xscale("log", base=2)
        ax.set_xticks(seqlens, [f"{s // 1024}k" for s in seqlens], fontsize=8)
        ax.set_title(f"d = {d}, {'causal' if causal else 'non-causal'}", fontsize=9)
        if col == 0:
            ax.set_ylabel("TFLOP/s (backward)")
fig.legend(*axes[0, 0].get_legend_handles_labels(), loc="lower center", ncol=len(impls), fontsize=8)
fig.suptitle(f"backward, bf16, {doc['device']}", fontsize=10)
plt.tight_layout(rect=(0, 0.05, 1, 1))
plt.show()
fa4_name = "flash-attn-4 (official)"
for impl in impls:
    if impl != fa4_name:
        ratio = [tf[(impl, *c)] / tf[(fa4_name, *c)] for c in {k[1:] for k in tf} if (impl, *c) in tf and (fa4_name, *c) in tf]
        print(f"{label[impl]:<24} / official FA4, same run: {min(ratio):.2f}x .. {max(ratio):.2f}x "
              f"(median {np.median(ratio):.2f}x)")

# %% [markdown]
# A benchmarking detail that matters: the peers are timed with `torch.autograd.grad(out, (q, k, v),
# dout)`, not `out.backward(dout)`. `.backward` also adds the new gradients into `q.grad`, `k.grad`,
# `v.grad` on every call: three elementwise kernels over the whole tensors that the kernel under test
# never runs, which at 1k tokens is a large share of the time. The deterministic mode's cost is the
# semaphore waits; the paper reports its deterministic backward at "up to 75% the speed of the
# nondeterministic backward" on B200, with the swizzling and SPT order of notebook 05.
#
# ## When ptxas quietly serializes the wgmmas
# A wgmma is asynchronous: a warpgroup issues it and goes on with other work until it waits for the
# result. If the accumulators, the operands and everything else live at the same time do not fit the
# registers, ptxas still compiles the kernel, but makes each wgmma wait for the one before it, and
# only says so in a compile remark (`C7512 ... wgmma.mma_async instructions are serialized due to
# insufficient register resources`). The kernel stays correct; it just loses the overlap, and a
# benchmark blames whatever technique was being tried. Every compile in this project reads the
# remark into its report and raises a `WgmmaSerializedWarning`; in the SASS a serialized build waits
# for all wgmmas (`WARPGROUP.DEPBAR.LE gsb0, 0x0`) after every HGMMA, an asynchronous one only where
# the algorithm needs a result. The production builds above:

# %%
from stage3_fwd_kernel.compile_cache import WgmmaSerializedWarning

for det, build in builds.items():
    full_waits = build.sass.count("WARPGROUP.DEPBAR.LE gsb0, 0x0")  # "wait until no wgmma is in flight"
    print(f"deterministic={det!s:<5}: HGMMA {build.report['HGMMA']}, full wgmma waits {full_waits}, "
          f"ptxas: {build.report['wgmma_serialized'] or 'asynchronous'}")
    assert not build.report["wgmma_serialized"] and full_waits < build.report["HGMMA"]
print(f"a serialized compile warns with {WgmmaSerializedWarning.__name__}; turn it into an error in a test with "
      f"warnings.simplefilter('error', {WgmmaSerializedWarning.__name__})")

# %% [markdown]
# ## What runs under the dP wgmma
# The tile body waits for two wgmmas in a row: for S^T, then `P^T = exp2(S^T scale - lse)`; for dP^T,
# then `dS^T = P^T (dP^T - D)`. Exponentials issued between the two waits run while the dP^T wgmma
# does; the others run after it has finished, with the tensor cores idle until dV is issued. So the
# number of exponentials ahead of the second wait is worth reading from the SASS. The production
# kernel gets ptxas to schedule more of them there by selecting `-inf` for key rows past the sequence
# in every tile, the unmasked one included: the select never fires there, so the bits are the same,
# but it changes the dependence graph ptxas schedules. `sass_report.wgmma_loop_bodies` finds the
# unmasked tile body (the shortest loop with wgmmas):

# %%
from stage3_fwd_kernel import sass_report

hot = sass_report.wgmma_loop_bodies(builds[False].sass)[0]
ahead = s4_common.exps_before_second_wait(hot)
print(f"d = 128 causal: {len(hot)} instructions in the tile body, {sum(op.startswith('HGMMA') for op in hot)} HGMMA; "
      f"{ahead} of {sum(op.startswith('MUFU.EX2') for op in hot)} exponentials before the dP wait")

# %% [markdown]
# Two more pieces of the production kernel are visible only in how it walks and loads:
#
# * **The producer loads the row statistics.** Every Q tile needs its rows' `lse2` and `D` (one fp32
#   each per query). Loaded by the consumer threads, that is global loads, shared stores and a
#   barrier on the warps that also run the five MMAs; the production kernel lets its producer warp
#   bring them with two more 1-D TMA boxes on the same mbarriers as Q and dO. A TMA box must start
#   16-byte aligned, so each varlen sequence's statistics start at an aligned offset
#   (`common.stats_offset`).
# * **Q tiles counted from the end (`q_shift`).** For K/V tile `n`, a causal walk starts at the Q tile
#   holding row `128 n` and ends at the last tile. With 80-row Q tiles counted from row 0, both ends
#   can be partial: 128 / 80 is not whole, and 4096 = 51 x 80 + 16 leaves the *last* tile of every
#   walk with 16 live rows of 80. Counted from the sequence's end instead (`top_padding` rows before
#   query 0, which the TMA loads past the tensor's start as zeros), only the diagonal tile is partial.
#   The walk bounds are `schedule.py`'s, with seqlen_q moved by the padding (bottom-right causal
#   alignment depends only on seqlen_k - seqlen_q):

# %%
def rows_walked(seqlen, tile_m, pad):
    spans = [s4_schedule.m_block_range(n, tile_m, 128, seqlen + pad, seqlen, True) for n in range(seqlen // 128)]
    return [(hi - lo) * tile_m for lo, hi in spans]


S = 4096
pad = (80 - S % 80) % 80 // 4 * 4
walks = {"80-row tiles from row 0": rows_walked(S, 80, 0), f"80-row tiles from the end (pad {pad})": rows_walked(S, 80, pad),
         "64-row tiles": rows_walked(S, 64, 0)}
live = [S - 128 * n for n in range(S // 128)]
fig, ax = plt.subplots(figsize=(9, 3.2))
for name, walked in walks.items():
    ax.step(range(len(walked)), [r - l for r, l in zip(walked, live)], where="mid",
            label=f"{name}: {sum(walked) / sum(live) - 1:+.1%}")
ax.set(xlabel="K/V tile n (128 keys)", ylabel="rows walked past the data", title="causal, 4k: rows a CTA walks beyond the live ones")
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## One schedule, two GPUs: where dV goes
# The tile body has a choice about dV += P^T dO. Issued right after P^T is formed, the dV wgmma
# overlaps the dS^T arithmetic; issued after dS^T, the fp32 P^T, its 16-bit copy and dP^T are never
# all live, so the register peak is lower. The 80- and 128-query tiles need the lower peak (their
# accumulators leave no room), so only d = 96's 64-query tile had a real choice, and on an H100 the
# early dV won (the later order lost 2-6% non-causal). Re-timed on an H200 with today's kernel, the
# order reverses at every length, in deterministic mode too; the early order is gone from the code.
# The JSON is the paired-rounds run the decision rests on (official time / ours per round, median):

# %%
dv_doc = json.loads((RESULTS / "ab_bwd_h200_d96_late_dv_noncausal.json").read_text())
dv_rows = {(r["impl"], r["seqlen"]): r["ratio_median"] for r in dv_doc["results"]}
dv_lens = sorted({s for _, s in dv_rows})
dv_builds = {"production": "dV right after P^T", "production~late_dv=1": "dV after dS^T",
             "production+det": "deterministic, dV right after P^T", "production~late_dv=1+det": "deterministic, dV after dS^T"}
fig, ax = plt.subplots(figsize=(7, 3.2))
for impl, name in dv_builds.items():
    ax.plot(dv_lens, [dv_rows[(impl, s)] for s in dv_lens], "o-" if "det" not in impl else "s--", label=name, ms=4)
ax.axhline(1.0, color="k", lw=0.8)
ax.set_xscale("log", base=2)
ax.set_xticks(dv_lens, [f"{s // 1024}k" for s in dv_lens])
ax.set(xlabel="sequence length (32k tokens a batch)", ylabel="official time / ours",
       title=f"d = 96, non-causal, {dv_doc['device']}")
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()
gain = [dv_rows[("production~late_dv=1", s)] / dv_rows[("production", s)] - 1 for s in dv_lens]
print("dV after dS^T against dV right after P^T: " + ", ".join(f"{s // 1024}k {g:+.1%}" for s, g in zip(dv_lens, gain)))

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
c64 = s4_roofline.backward_tile_cycles(128, 128, 64, B200)
print(c64, "->", c64.bound, f", SMEM / MMA = {c64.smem / c64.mma:.2f}")
assert (c64.mma, c64.smem_operands, c64.smem_ds_write, c64.smem_dq, c64.smem) == (1280, 1152, 256, 512, 1920)
assert c64.smem / c64.mma > one.smem / one.mma

# %% [markdown]
# **Next**: [05 · scheduling](05_scheduling.ipynb): the order in which tiles go to SMs, and the
# shortest-first order of the deterministic backward on a whole GPU.
