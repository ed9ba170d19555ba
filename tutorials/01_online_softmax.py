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
# # 01 · Online softmax, and the rescales FA4 skips
#
# **What you will learn**
# - how FlashAttention computes attention tile by tile with three running quantities per row
#   (`m_i`, `l_i`, `O_i`), never storing the score matrix;
# - FA4's *conditional rescaling*: move the running max only when it grows by more than
#   `tau = 8` (log2 units), and why that is exact rather than an approximation;
# - where the argument ends (fp32 accumulators, `tau` near 128).
#
# **The idea, in the paper's words** (§3.1.4, *Skipping online softmax rescaling*): "Rescaling
# is only necessary when `m_j > m_{j-1}` ... We can tolerate some slack in the rescaling: only
# rescale when `m_j - m_{j-1} > tau` ... As long as we keep track of the statistics, we can still
# get the true denominator at the end."
#
# **Code path**: `stage1_online_softmax/flash.py`. Diff it against `stage0_reference/reference.py`.

# %%
import matplotlib.pyplot as plt
import numpy as np

from stage0_reference import attention_forward
from stage1_online_softmax import flash_forward

rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, s, 2, 64)) for s in (512, 4096, 4096))
out_ref, lse_ref = attention_forward(q, k, v, causal=True)

# %% [markdown]
# ## Rescales done vs skipped as the threshold varies
# For each (row, K block) pair whose block max exceeds the row's kept max `m_i`, the kernel either
# multiplies `O_i` and `l_i` (a "rescale") or keeps the stale max. `tau = 0` is classic
# FlashAttention, where `m_i` is always the true running max; with `tau > 0` a kept max is often
# stale, so more blocks exceed it (the "skipped" bars count those, not blocks that grew the true max).

# %%
taus = [0, 0.25, 0.5, 1, 2, 4, 8, 16]
done, skipped, errs = [], [], []
for tau in taus:
    o, lse, st = flash_forward(q, k, v, causal=True, rescale_threshold=tau)
    done.append(st.done)
    skipped.append(st.skipped)
    errs.append(np.abs(o - out_ref).max())

fig, ax = plt.subplots(1, 2, figsize=(11, 3.5))
x = np.arange(len(taus))
ax[0].bar(x - 0.2, done, 0.4, label="rescaled")
ax[0].bar(x + 0.2, skipped, 0.4, label="skipped")
ax[0].set_xticks(x, [str(t) for t in taus])
ax[0].set_xlabel("threshold tau (log2 units)")
ax[0].set_ylabel("(row, K block) pairs above the kept max")
ax[0].legend()
ax[1].semilogy(x, np.maximum(errs, 1e-17), "o-")
ax[1].set_xticks(x, [str(t) for t in taus])
ax[1].set_xlabel("threshold tau")
ax[1].set_ylabel("max |out - oracle| (float64)")
ax[1].set_ylim(1e-17, 1e-10)
fig.suptitle("causal, 512 queries x 4096 keys, 128x128 tiles")
plt.tight_layout()
plt.show()
print("rescaled:", dict(zip(taus, done)))

# %% [markdown]
# The error stays at float64 round-off for every `tau` while the rescales vanish. With random
# inputs the max settles after the first blocks and afterwards creeps up by small steps, which
# `tau = 8` absorbs entirely.
#
# ## Why skipping is exact
# With a stale max `m_i`, each term is `2^(S - m_i)`. We only skip when the new max exceeds
# `m_i` by at most `tau`, so every term is `<= 2^tau` (256 for `tau = 8`), and
# `l_i <= Sk * 2^tau`. `O_i` and `l_i` carry the *same* factor `2^(-m_i)`, which cancels in the
# final `O_i / l_i`. Bounded terms cannot overflow; a common factor cannot change a ratio.
#
# The worst case for the bound is scores that rise along the row, so the stale max is as stale as
# allowed. The run below records the largest term ever accumulated.

# %%
def rising(sq, sk, log2_step):
    qq = np.zeros((1, sq, 1, 8)); qq[..., 0] = 1.0
    kk = np.zeros((1, sk, 1, 8)); kk[0, :, 0, 0] = np.arange(sk) * log2_step / np.log2(np.e)
    return qq, kk, rng.standard_normal((1, sk, 1, 8))

qr, kr, vr = rising(32, 4096, 0.01)  # 1.28 log2 units per 128-key block: the max creeps up
max_terms = []
bounds = [0, 1, 2, 4, 6, 8, 10, 12]
for tau in bounds:
    max_terms.append(flash_forward(qr, kr, vr, softmax_scale=1.0, rescale_threshold=tau)[2].max_term)
plt.figure(figsize=(5, 3.5))
plt.semilogy(bounds, max_terms, "o-", label="largest term accumulated")
plt.semilogy(bounds, [2.0**t for t in bounds], "k--", label="bound 2^tau")
plt.xlabel("tau"); plt.ylabel("term size"); plt.legend(); plt.tight_layout(); plt.show()
assert all(m <= 2.0**t * (1 + 1e-12) for m, t in zip(max_terms, bounds))

# %% [markdown]
# ## Where it ends: fp32 and a large tau
# Kernels accumulate in fp32, whose largest value is about `2^128`. A threshold of 130 would let a
# single term reach `2^129`: the output is destroyed. A small constant like 8 costs 8 bits of
# headroom out of 128 and loses nothing.

# %%
qr, kr, vr = rising(16, 256, 1.01)  # 129 log2 units across one block
o64, _ = attention_forward(qr, kr, vr, softmax_scale=1.0)
for tau in (0, 8, 130):
    with np.errstate(over="ignore", invalid="ignore"):
        o32, _, _ = flash_forward(qr, kr, vr, softmax_scale=1.0, rescale_threshold=tau,
                                  block_m=16, block_n=128, accum_dtype=np.float32)
    print(f"tau={tau:>3}: max error in fp32 = {np.abs(o32 - o64).max():.2e}")

# %% [markdown]
# ## Exercise
# The kernels decide per *warp*, not per row: if any row handled by a warp needs a rescale, the
# whole warp rescales (no divergence). `flash_forward(..., rows_per_vote=16)` models a Hopper warp.
# Predict: does voting change the output? Does it change the number of rescales? Check it.
#
# <details><summary>Answer</summary>
#
# The output is unchanged (a rescale is always allowed; it is skipping that needs the bound).
# The count can only go up: rows whose max grew by less than `tau` get rescaled with their group.
# </details>

# %%
o_row, _, st_row = flash_forward(q, k, v, causal=True, rescale_threshold=2.0)
o_vote, _, st_vote = flash_forward(q, k, v, causal=True, rescale_threshold=2.0, rows_per_vote=16)
assert np.allclose(o_row, o_vote, atol=1e-13) and st_vote.done >= st_row.done
print("rescales per row:", st_row.done, " with a 16-row vote:", st_vote.done)

# %% [markdown]
# **Next**: [02 · emulated exp2](02_emulated_exp.ipynb): the other softmax bottleneck, the
# exponential unit, and how FA4 moves part of its work onto the FMA units.
