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
# # 02 · `2^x` without the exponential unit
#
# **What you will learn**
# - why the exponential unit (MUFU, 16 ops per clock per SM) is a bottleneck next to tensor cores;
# - how `2^x` is computed with adds, fused multiply-adds and one integer add: Cody-Waite range
#   reduction plus a minimax polynomial, fitted here from first principles with mpmath;
# - how to prove a GPU instruction sequence right bit for bit, and what it buys on an H100.
#
# **The idea, in the paper's words** (§3.1.3, *Emulation of the exponential function*):
# "`2^x = 2^floor(x) 2^(x - floor(x))` ... The integer part can be computed efficiently using bit
# manipulation ... For the fractional part, we approximate `2^x_frac` using a polynomial ...
# By distributing exponential computations across both MUFU and FMA units, this approach
# effectively increases the exponential throughput."
#
# **Code path**: `stage2_emulated_exp/` — `minimax.py` (the fit), `host_model.py` (the bit-exact
# float32 model), `exact_model.py` (the slow witness), `gpu_kernel.py` (the PTX), `gpu_bench.py`.

# %%
import matplotlib.pyplot as plt
import numpy as np

from stage2_emulated_exp.host_model import exp2_emulated, exp2_emulated_steps
from stage2_emulated_exp.minimax import coefficient_table

# %% [markdown]
# ## The sequence, one value at a time
# Each line below is one GPU instruction. `j` is `x + 1.5 * 2^23` rounded toward minus infinity:
# in `[2^23, 2^24)` one ulp is 1, so the rounding *is* the floor, and the low bits of `j` hold
# `floor(x)` as an integer, ready to be shifted into the exponent field.

# %%
x = np.array([3.7, -0.25, -126.5, 0.0], dtype=np.float32)
steps = exp2_emulated_steps(x, degree=3)
for name in ("xc", "j", "floor", "frac", "poly", "out"):
    print(f"{name:>6}: {steps[name]}")
print(" exact:", np.exp2(x.astype(np.float64)))

# %% [markdown]
# Three of the four values match the exact ones to the polynomial's accuracy (about 1e-4 at degree 3).
# `x = -126.5` does not: the model is accurate only for `x >= -126`. The last step writes `floor(x) + 127` into the 8-bit exponent
# field of the polynomial's result `p` in `[1, 2)`. For `x >= -126` that field is at least 1, a normal
# float: `p * 2^floor(x)`. At `floor(x) = -127` it is 0, which float32 reads as a *subnormal*: no
# implicit leading 1 and a scale of `2^-126`, so the bits mean `(p - 1) * 2^-126` instead of
# `p * 2^-127`. For `x = -126.5`, `p = 2^0.5 = 1.414`: the result is `0.414 * 2^-126`, 41% below the
# exact `1.414 * 2^-127`. Below -127 the clamp gives exactly 0. Attention never needs these values:
# `P = 2^(s - m)` is at most 1 and a row's sum is at least 1 (its max term), so a term below `2^-126`
# changes neither the sum nor, after rounding to 16 bits, the P fed to the next matmul. The scan shows
# where the model stops being accurate:

# %%
xs = np.linspace(-128, -124, 4001, dtype=np.float32)
rel = exp2_emulated(xs).astype(np.float64) / np.exp2(xs.astype(np.float64)) - 1
plt.figure(figsize=(7, 3))
plt.plot(xs, np.abs(rel) + 1e-12, lw=0.8)
plt.axvline(-126, color="r", lw=0.8)
plt.text(-125.95, 1e-3, "x = -126: the smallest normal float32", color="r", fontsize=8)
plt.yscale("log")
plt.xlabel("x")
plt.ylabel("|relative error| (+1e-12)")
plt.title("accurate down to x = -126; subnormal bits below, 0 below the clamp at -127")
plt.tight_layout()
plt.show()
assert np.abs(rel[xs >= -126]).max() < 1e-4 and abs(rel[xs == np.float32(-126.5)][0] + 0.414) < 0.01

# %% [markdown]
# ## The polynomial: a minimax fit with `p0 = 1`
# Remez's exchange algorithm finds the polynomial whose largest *relative* error on `[0, 1)` is as
# small as possible; the error then equioscillates. Rounding the coefficients to float32 costs a
# little; `minimax.py` refits around the rounding.

# %%
print(coefficient_table(degrees=(3, 4, 5)))

# %%
f = np.linspace(0, 1, 20001, dtype=np.float32)
plt.figure(figsize=(7, 3.5))
for d in (3, 4, 5):
    rel = exp2_emulated(f, degree=d).astype(np.float64) / np.exp2(f.astype(np.float64)) - 1
    plt.plot(f, rel, label=f"degree {d}", lw=0.8)
plt.yscale("symlog", linthresh=1e-8)
plt.xlabel("f = x - floor(x)")
plt.ylabel("relative error (float32 result)")
plt.title("equioscillation: the error touches its max |E| at n+1 points")
# degree 5's error (~1e-7) is as small as float32 rounding itself, hence its noisy band
plt.legend()
plt.tight_layout()
plt.show()

# %% [markdown]
# ## The paper's accuracy table
# 4M inputs in `[0, 1)`; "BF16" rounds the float32 result to bfloat16 first. After BF16 rounding,
# every degree >= 3 is as good as exact: attention consumes P in BF16.

# %%
from stage2_emulated_exp.accuracy import accuracy_table

print(accuracy_table(n=1_000_000))  # 1M here to keep the notebook quick; the paper uses 4M

# %% [markdown]
# ## Proof by a second implementation
# `host_model` is vectorized NumPy with a hand-built single-rounding FMA and round-toward-minus-
# infinity add. `exact_model` does the same with Python fractions, one value at a time. They must
# agree on every bit, including the awkward places: integers, just below integers, the -127 clamp.

# %%
from stage2_emulated_exp.exact_model import exp2_emulated_exact_bits

probe = np.array([5.0, np.nextafter(np.float32(5), np.float32(0)), -127.0, -126.5, 127.99, 0.5],
                 dtype=np.float32)
fast = exp2_emulated(probe).view(np.uint32)
slow = np.array([exp2_emulated_exact_bits(int(b)) for b in probe.view(np.uint32)], dtype=np.uint32)
print([hex(v) for v in fast])
assert np.array_equal(fast, slow)

# %% [markdown]
# ## The same sequence as GPU instructions
# `gpu_kernel.py` writes each step as one inline-PTX instruction so the compiler can neither fuse
# nor re-round anything. Without a GPU we compile for Hopper and read the SASS: 8 instructions per
# value, 6 on the FMA pipe, no `MUFU.EX2`. On a GPU the cell also runs it against the host model.

# %%
import torch

from stage2_emulated_exp import gpu_kernel

kernels = gpu_kernel.compile_only("sm_90a")
sass = kernels["emulated_d3"]["sass"]
ops = [ln.split("*/")[-1].strip().split(" ")[0] for ln in sass.splitlines() if "/*0" in ln and "*/" in ln]
chain = [op for op in ops if op.split(".")[0] in ("FMNMX", "FADD", "FFMA", "LEA", "MUFU")]
print("instruction classes in the emulated kernel:", sorted(set(op.split(".")[0] for op in chain)))
assert not any(op.startswith("MUFU") for op in chain)
if torch.cuda.is_available():
    xg = torch.randn(1 << 20, device="cuda") * 40
    y = gpu_kernel.exp2_gpu(xg, method="emulated", degree=3)
    same = np.array_equal(y.cpu().numpy().view(np.uint32), exp2_emulated(xg.cpu().numpy()).view(np.uint32))
    print("GPU == host model, bit for bit:", same)

# %% [markdown]
# ## What it buys on an H100 (committed device results)
# Measured with `python -m stage2_emulated_exp.device_main` on an H100: exp2 results
# per clock per SM when a fraction of the values is emulated and the rest go to MUFU.

# %%
from stage2_emulated_exp import results

print(results.bitexact_summary())
rows = [r for r in results.throughput_rows() if r["fraction"] is not None and r["degree"] == 3]
plt.figure(figsize=(6, 3.5))
plt.plot([100 * r["fraction"] for r in rows], [r["measured"] for r in rows], "o-", label="measured (H100)")
plt.plot([100 * r["fraction"] for r in rows], [r["model"] for r in rows], "k--", lw=0.8, label="issue-rate model")
plt.axhline(16, color="gray", lw=0.5)
plt.xlabel("% of exponentials emulated (degree 3)")
plt.ylabel("exp2 per clock per SM")
plt.legend()
plt.tight_layout()
plt.show()
best = results.best_mix()
print(f"best: {best['fraction']:.0%} emulated -> {best['measured']:.1f} per clock (MUFU alone: {rows[0]['measured']:.1f})")

# %% [markdown]
# On Hopper, emulating *everything* is slower than MUFU: 8 instructions per value against one, and
# instruction issue is the limit. A mix wins because both units work at once — about 1.26x at
# 30-35%. That is the paper's "partial emulation", and why its fraction is 10-25% and tuned.
#
# ## Exercise
# The clamp is at -127, not -126. What would go wrong with no clamp at all for `x = -200`?
# Use `exp2_emulated_steps` on a copy of the sequence without the clamp to find out
# (hint: look at `j` and what `bits(j) << 23` adds to the exponent field).
#
# <details><summary>Answer</summary>
#
# `floor = -200` shifted into the exponent field wraps the 8-bit exponent: the integer add borrows
# from the sign bit and yields a large negative or garbage float instead of 0. With the clamp,
# every `x <= -127` gives exactly `+0.0`, which is what masked scores (`-inf`) need.
# </details>

# %%
assert exp2_emulated(np.array([-200.0, -np.inf], dtype=np.float32)).tolist() == [0.0, 0.0]

# %% [markdown]
# **Next**: 03 · the forward kernel — stage 3 puts stages 1 and 2 on the tensor cores.
