# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 00 · Attention, the slow and certain way
#
# **What you will learn**
# - what attention computes, in the notation every later stage uses (`q (B, S, H, D)`, `lse`);
# - the three details kernels must get exactly right: the causal mask when `seqlen_q != seqlen_k`,
#   grouped-query attention (GQA), and rows that see no key at all;
# - the backward pass as FlashAttention writes it (`dS = P * (dP - D)`), and how we know it is right.
#
# **The idea, in the paper's words** (§2.1, *Multi-Head Attention*): given queries, keys and values,
# attention computes `S = Q K^T`, `P = softmax(S)` row by row, and `O = P V`. The backward pass
# needs `dV = P^T dO`, `dP = dO V^T`, `dS = dsoftmax(dP)`, `dQ = dS K`, `dK = dS^T Q`.
#
# **Code path**: `stage0_reference/reference.py` (NumPy, float64). Every kernel in this project is
# tested against it.

# %%
import numpy as np

from stage0_reference import attention_backward, attention_forward, visible_mask

rng = np.random.default_rng(0)
B, Sq, Sk, Hq, Hkv, D = 1, 5, 8, 4, 2, 16
q = rng.standard_normal((B, Sq, Hq, D))   # (B, Sq, Hq, D)
k = rng.standard_normal((B, Sk, Hkv, D))  # (B, Sk, Hkv, D): 2 query heads share each kv head
v = rng.standard_normal((B, Sk, Hkv, D))
out, lse = attention_forward(q, k, v, causal=True)
print("out", out.shape, " lse", lse.shape)

# %% [markdown]
# ## The causal mask, aligned bottom-right
# With 5 queries and 8 keys, the *last* query sees every key and the first sees 4: the mask is
# aligned to the bottom-right corner (the FlashAttention-2 convention, natural for decoding where
# the new queries come after a cached prefix).

# %%
print(visible_mask(Sq, Sk, causal=True).astype(int))

# %% [markdown]
# If there are more queries than keys, the first rows see nothing. Their output is 0 and their
# `lse` is `-inf` — never NaN. A kernel that gets this wrong produces NaNs that poison training.

# %%
out2, lse2 = attention_forward(rng.standard_normal((1, 6, 1, 4)), rng.standard_normal((1, 3, 1, 4)),
                               rng.standard_normal((1, 3, 1, 4)), causal=True)
print(visible_mask(6, 3, causal=True).astype(int))
print("lse:", lse2[0, 0])

# %% [markdown]
# ## A check you can run: the backward against torch autograd
# `lse` is what lets the backward recompute `P = exp(S * scale - lse)` without storing it.

# %%
import torch

dout = rng.standard_normal(out.shape)
dq, dk, dv = attention_backward(q, k, v, out, dout, lse, causal=True)

tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
mask = torch.tensor(visible_mask(Sq, Sk, True))
s = torch.einsum("bqhd,bkhd->bhqk", tq, tk.repeat_interleave(Hq // Hkv, 2)) / D**0.5
p = torch.softmax(s.masked_fill(~mask, -torch.inf), dim=-1)
torch.einsum("bhqk,bkhd->bqhd", p, tv.repeat_interleave(Hq // Hkv, 2)).backward(torch.tensor(dout))
for name, mine, ref in (("dq", dq, tq.grad), ("dk", dk, tk.grad), ("dv", dv, tv.grad)):
    print(name, "max |difference| =", f"{np.abs(mine - ref.numpy()).max():.1e}")
    assert np.allclose(mine, ref.numpy(), atol=1e-12)

# %% [markdown]
# ## Three variants today's models use
# All three change only the scores or the softmax's denominator, so the same oracle serves them:
# - **sliding window** `window_size=(left, right)` (Mistral, Gemma): row `i` sees keys
#   `j` with `i + off - left <= j <= i + off + right` (`off = Sk - Sq`, as for causal; `None` or
#   `-1` is unlimited, and causal is `right = 0`). A kernel skips the key blocks outside the band,
#   so its cost follows the window, not the sequence;
# - **softcap** (Gemma 2): each scaled score `s` becomes `softcap * tanh(s / softcap)`;
# - **learnable sink** (gpt-oss): one more logit per head joins every row's denominator and carries
#   no value, so a row can put weight "nowhere".

# %%
print("causal + window (2, 0):")
print(visible_mask(Sq, Sk, causal=True, window=(2, 0)).astype(int))
print("two-sided window (1, 1), not causal:")
print(visible_mask(Sq, Sk, causal=False, window=(1, 1)).astype(int))
sink = np.full(Hq, 1.5)
out_s, lse_s = attention_forward(q, k, v, causal=True, learnable_sink=sink)
# the sink only adds exp(sink) to each row's sum: lse grows, and out shrinks by exp(lse - lse_s)
assert np.allclose(lse_s, np.logaddexp(lse, sink[None, :, None]))
assert np.allclose(out_s, out * np.exp(lse - lse_s).transpose(0, 2, 1)[..., None])
capped, lse_c = attention_forward(q * 10, k, v, causal=True, softcap=2.0)
print("softcap 2: every capped logit is in (-2, 2), so lse - log(visible keys) is too:",
      np.abs(lse_c - np.log(visible_mask(Sq, Sk, causal=True).sum(1))[None, None, :]).max() < 2)

# %% [markdown]
# ## Exercise
# GQA: each kv head serves `Hq // Hkv` query heads, so its gradient must be the **sum** of the
# gradients those query heads send it. Verify that by calling `attention_backward` with `k`, `v`
# repeated to `Hq` heads, then reducing `dk` yourself.
#
# <details><summary>Answer</summary>
#
# ```python
# kx, vx = np.repeat(k, Hq // Hkv, axis=2), np.repeat(v, Hq // Hkv, axis=2)
# o_x, lse_x = attention_forward(q, kx, vx, causal=True)
# _, dk_x, _ = attention_backward(q, kx, vx, o_x, dout, lse_x, causal=True)
# assert np.allclose(dk, dk_x.reshape(B, Sk, Hkv, Hq // Hkv, D).sum(3))
# ```
# </details>

# %%
# the answer, checked (so this notebook fails if the claim ever stops being true)
kx, vx = np.repeat(k, Hq // Hkv, axis=2), np.repeat(v, Hq // Hkv, axis=2)
o_x, lse_x = attention_forward(q, kx, vx, causal=True)
_, dk_x, _ = attention_backward(q, kx, vx, o_x, dout, lse_x, causal=True)
assert np.allclose(dk, dk_x.reshape(B, Sk, Hkv, Hq // Hkv, D).sum(3))

# %% [markdown]
# **Next**: [01 · online softmax](01_online_softmax.ipynb) computes the same thing without ever
# storing the `(Sq, Sk)` matrix — and shows FA4's trick for skipping most of the rescaling work.
