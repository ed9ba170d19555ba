# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.7
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 03 · The forward kernel: a Hopper ladder, a composed product, then Blackwell
#
# **What you will learn**
# - how stage 1's loop nest becomes a CuTe-DSL kernel in four diffable lessons: wgmma, a TMA
#   pipeline, warp specialization with two ping-ponging consumer warpgroups, and FA4's softmax;
# - the paper's roofline (tensor cores, shared memory, exponential unit per tile), and why on
#   Hopper the exponential unit matters at small head dims (`exp / MMA = 64 / d`);
# - what the production kernel adds around the lessons' tile loop: persistent CTAs, a split last
#   wave, P through shared memory when registers run out (d = 96), wgmma descriptors built once, and
#   P packed between the exponentials;
# - how the Blackwell kernel spends its 512 columns of tensor memory, why a correction warpgroup
#   takes the O rescale off the softmax's path, and why P is stored in two stages.
#
# **The idea, in the paper's words** (§3.1.1, *Feeds and Speeds*, and §3.1.2, *New pipeline to
# overlap matmul and softmax*): "This analysis motivates our kernel design to (1) use large tile
# sizes and maximize overlap between MMA operations and softmax computations (2) increase the
# throughput of exponential by using other hardware units (3) reduce the time of unnecessary
# non-matmul operations." ... "We follow a ping-pong schedule similar to FA-3, where two tiles of
# the output are computed per thread block. While one tile's tensor core operations are executed,
# the other tile computes softmax."
#
# **Code path**: `stage3_fwd_kernel/` — the lessons `hopper_step1_wgmma.py` → `hopper_step2_tma.py` →
# `hopper_step3_warpspec.py` → `hopper_step4_fa4_softmax.py`; the production kernel
# `stage3_fwd_kernel.hopper` (what `fa4` runs, composed from `components/`); `softmax_policy.py`
# (the FA4 softmax, shared with Blackwell); `roofline.py`; `blackwell_config.py` + `blackwell_fwd.py`.
#
# **Status**: the lessons and the production kernel are tested on Hopper GPUs (`python -m pytest -m gpu`);
# the measurements below are committed results from an H100 (`benchmarks/results/`, each with its
# command). On a CPU-only machine the notebook *compiles* the kernels for `sm_90a` and shows the
# committed numbers. The Blackwell kernel is compiled for `sm_100a` in the tests and has never run on
# hardware. How each technique was measured, run by run, is in `docs/measurements.md`.

# %%
import ast
import difflib
import importlib
import json
import pathlib
import re

import matplotlib.pyplot as plt
import numpy as np

import stage3_fwd_kernel
from stage3_fwd_kernel.roofline import B200, H100, forward_tile_cycles

PKG = pathlib.Path(stage3_fwd_kernel.__file__).resolve().parent
RESULTS = PKG.parent / "benchmarks" / "results"  # from the package's location: any working directory works

# %% [markdown]
# ## The ladder: four lessons, one technique each
# Each step is a whole runnable kernel with the same interface (`compile_only`, `attention_forward`,
# `run`), and its docstring opens with "Compared with the previous step, this adds X because Y".
# The table is computed from the files themselves: lines of code (module docstring excluded), a
# `difflib` line diff against the previous step, and the registers and shared memory each step
# compiles to here (bf16, d = 128).

# %%
LADDER = ["hopper_step1_wgmma", "hopper_step2_tma", "hopper_step3_warpspec", "hopper_step4_fa4_softmax"]


def read_step(name):
    """(code lines without the module docstring, the docstring)."""
    text = (PKG / f"{name}.py").read_text()
    tree = ast.parse(text)
    return text.splitlines()[tree.body[0].end_lineno:], ast.get_docstring(tree)


def diff_stats(old, new):
    """(lines added or rewritten, lines removed or rewritten, lines kept) from old to new."""
    ops = difflib.SequenceMatcher(None, old, new, autojunk=False).get_opcodes()
    added = sum(j2 - j1 for tag, i1, i2, j1, j2 in ops if tag in ("replace", "insert"))
    removed = sum(i2 - i1 for tag, i1, i2, j1, j2 in ops if tag in ("replace", "delete"))
    return added, removed, sum(i2 - i1 for tag, i1, i2, j1, j2 in ops if tag == "equal")


def adds(doc):
    """The bold 'this adds **...**' phrase of a step's docstring (step 1: its first line)."""
    m = re.search(r"\*\*(.+?)\*\*", doc, re.S)
    return " ".join((m.group(1) if m else doc.splitlines()[0]).split())


steps = {name: read_step(name) for name in LADDER}
builds = {name: importlib.import_module(f"stage3_fwd_kernel.{name}").compile_only("bf16", 128, 128, False)
          for name in LADDER}
stats = {}
print(f"{'step':<26} {'code lines':>10} {'+added':>7} {'-removed':>8} {'regs':>5} {'SMEM KB':>8}  adds")
for prev, name in zip([None] + LADDER, LADDER):
    code, doc = steps[name]
    a, r, same = diff_stats(steps[prev][0], code) if prev else (len(code), 0, 0)
    stats[name] = (a, r, same)
    rep = builds[name].report
    print(f"{name:<26} {len(code):>10} {a:>7} {r:>8} {rep['registers']:>5} {rep['smem_bytes'] / 1024:>8.0f}  "
          f"{adds(doc)[:70]}")
# a lesson is a diff a reader can hold: no neighbouring pair may grow past ~600 changed lines
assert all(stats[n][0] <= 600 for n in LADDER[1:]), {n: stats[n][:2] for n in LADDER[1:]}

# %%
fig, ax = plt.subplots(figsize=(8, 2.8))
y = np.arange(1, len(LADDER))
kept = [stats[n][2] for n in LADDER[1:]]
added = [stats[n][0] for n in LADDER[1:]]
ax.barh(y, kept, color="0.8", label="lines kept from the previous step")
ax.barh(y, added, left=kept, color="C1", label="lines added or rewritten")
ax.set_yticks(y, [f"{a.split('_', 1)[1]} → {b.split('_', 1)[1]}" for a, b in zip(LADDER, LADDER[1:])])
ax.invert_yaxis()
ax.set_xlabel("lines of code (docstrings excluded)")
ax.set_title("each step keeps most of the previous one")
ax.legend(loc="lower right", fontsize=8)
plt.tight_layout()
plt.show()


# %% [markdown]
# ### The key lines of each step, read from the diff
# A hunk of `difflib.unified_diff` between two steps, found by an anchor string (`+` added,
# `-` removed). These are excerpts; `diff` the files for the rest.

# %%
def hunk(old, new, anchors, limit=16):
    """The first diff hunk that adds a line containing one of `anchors`, from 3 lines before it."""
    diff = list(difflib.unified_diff(old, new, lineterm="", n=2))
    starts = [i for i, line in enumerate(diff) if line.startswith("@@")]
    for anchor in anchors:
        for s, e in zip(starts, starts[1:] + [len(diff)]):
            block = diff[s:e]
            hits = [i for i, line in enumerate(block) if line.startswith("+") and anchor in line]
            if hits:
                lo = max(1, hits[0] - 3)
                return anchor, "\n".join(block[lo:lo + limit])
    raise LookupError(f"no added line contains any of {anchors}")


ANCHORS = [["producer_get_barrier", "TMA", "tma"], ["barrier_id=my_turn", "my_turn", "named_barrier"],
           ["rescale_vote", "exp2_row", "vote"]]
for (a, b), anchors in zip(zip(LADDER, LADDER[1:]), ANCHORS):
    anchor, text = hunk(steps[a][0], steps[b][0], anchors)
    print(f"──── {a} → {b}   (anchor: {anchor})")
    print(text, "\n")

# %% [markdown]
# Reading the three hunks:
# - **step 2** replaces step 1's per-thread `cp.async` copies (and their row predicates) with one
#   TMA copy per tile that arrives on an mbarrier; a prologue puts the first `stages` tiles in
#   flight before the mainloop starts.
# - **step 3** wraps the GEMMs in a named-barrier *turn*: take the turn, issue, hand the turn to
#   the other consumer, and only then wait for the result. That is the ping-pong. Inside a turn it
#   issues `S_i = Q K_i^T` *and* the previous tile's `O += P_{i-1} V`, waits only for `S_i`
#   (`wait_group(1)`) and exponentiates while its own `P V` still runs: the intra-warpgroup overlap.
#   It walks the key blocks last first, so the masked ones come first and the hot loop is compiled
#   without mask code.
# - **step 4** changes only the online-softmax update: a warp vote decides whether the running max
#   moves at all (conditional rescaling, `tau = 8`: O and the row sum are rescaled only when some
#   row's max grew by more than tau = 8 in log2 units (a factor of `2^8`), which stays exact because the final `O / l` uses the same
#   stale max for both), and `exp2_row` can put a compile-time share of the exponentials on the FMA
#   pipe (stage 2's polynomial).
#
# ## The roofline: three resources per tile
# `roofline.py` prices one `M x N` tile with head dim `d` on one SM (paper §3.1.1):
# `T_MMA = 4MNd / FLOPs-per-clock`, `T_smem = operand bytes / 128 B per clock`,
# `T_exp = MN / 16`. The B200 rows are the paper's table; the H100 rows use Hopper's
# 4096 FLOP/clk/SM and wgmma's 64-row instructions (each consumer warpgroup re-reads K and V).

# %%
cases = [("H100", H100, 128, 128, d) for d in (64, 128, 256)] + [("B200", B200, m, 128, 128) for m in (128, 256)]
cyc = {(hw_name, m, n, d): forward_tile_cycles(m, n, d, hw) for hw_name, hw, m, n, d in cases}
for (hw_name, m, n, d), c in cyc.items():
    print(f"{hw_name} {m:>3} x {n} x {d:<3}  MMA {c.mma:>5.0f}  SMEM {c.smem:>5.0f}  exp {c.exp:>5.0f}  -> {c.bound}")
# the paper's Table (B200): 1024 / 768 / 1024 and 2048 / 1536 / 2048
assert [round(v) for v in cyc[("B200", 128, 128, 128)].as_row().values()] == [1024, 768, 1024]
assert [round(v) for v in cyc[("B200", 256, 128, 128)].as_row().values()] == [2048, 1536, 2048]

# %%
dims = [64, 96, 128, 192, 256]
fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 3.8), gridspec_kw={"width_ratios": [3, 2]})
x = np.arange(len(cyc))
for i, (res, color) in enumerate([("MMA", "C0"), ("SMEM", "C2"), ("exp", "C3")]):
    ax.bar(x + (i - 1) * 0.27, [c.as_row()[res] for c in cyc.values()], 0.27, color=color, label=res)
ax.set_xticks(x, [f"{hw}\n{m}x{n}x{d}\n→ {c.bound}" for (hw, m, n, d), c in cyc.items()], fontsize=8)
ax.axvline(2.5, color="k", lw=0.5)
ax.set_ylabel("cycles per tile (one SM)")
ax.set_title("H100 (this project's hardware) | B200 (the paper's table)")
ax.legend()
for hw, name, color in [(H100, "H100", "C0"), (B200, "B200", "C1")]:
    ratio = [forward_tile_cycles(128, 128, d, hw).exp / forward_tile_cycles(128, 128, d, hw).mma for d in dims]
    ax2.plot(dims, ratio, "o-", color=color, label=name)
emu = [forward_tile_cycles(128, 128, d, H100, exp_fraction_on_mufu=0.75) for d in dims]
ax2.plot(dims, [c.exp / c.mma for c in emu], "o--", color="C0", alpha=0.6, label="H100, 25% of exp2 emulated")
ax2.axhline(1, color="k", lw=0.6)
ax2.set_xticks(dims)
ax2.set_xlabel("head dim d")
ax2.set_ylabel("exp cycles / MMA cycles")
ax2.set_title("above 1: the exponential unit is the bound")
ax2.legend(fontsize=8)
plt.tight_layout()
plt.show()
for d in dims:  # the closed forms behind the right panel
    assert forward_tile_cycles(128, 128, d, H100).exp / forward_tile_cycles(128, 128, d, H100).mma == 64 / d
    assert forward_tile_cycles(128, 128, d, B200).exp / forward_tile_cycles(128, 128, d, B200).mma == 128 / d
print("exp/MMA on H100 = 64/d, on B200 = 128/d; d=64 on H100 with 25% emulated:",
      forward_tile_cycles(128, 128, 64, H100, exp_fraction_on_mufu=0.75).bound)

# %% [markdown]
# Blackwell doubled the tensor cores and kept the exponential unit, so the paper's `d = 128` tile
# is a tie between MMA and exp: that is why FA4 needs both the pipeline *and* the softmax tricks.
# On Hopper the tie moves to `d = 64`; at `d = 128` the exponential "only" fills half the tile
# time, which the ping-pong of step 3 has to hide under the other warpgroup's GEMMs.
#
# ## Who does what in step 3: a warp-role timeline (schematic)
# The picture below is **a schematic, not a measurement**. It replays step 3's protocol — the
# turn order of the named barriers, the `wait_group(0)` after each GEMM, the K/V ring of
# `stages` slots released after PV — with durations taken from the roofline: per 64-row consumer
# and 128-key tile, each GEMM takes `forward_tile_cycles(64, 128, d, H100).mma / 2` clocks and the
# softmax its exponentials, `64 * 128 / 16`. Loads get an assumed 600-clock latency. Everything
# else (FP32 math, issue slots, barrier latency) is left out.

# %%
def pingpong(d, n_blocks=4, stages=3, load_latency=600, tile_n=128):
    """Replay step 3's protocol; returns lists of (start, end, label) per timeline row."""
    c = forward_tile_cycles(64, tile_n, d, H100)
    gemm, softmax = c.mma / 2, c.exp  # one QK^T or PV of one consumer; its exponentials
    rows = {"producer warp\n(K/V in flight,\none lane per slot)": [], "tensor cores": [], "consumer WG 1": [],
            "consumer WG 2": []}
    tc_free = mufu_free = last_issue = 0.0
    ready = [load_latency, load_latency]  # both wait for Q
    released, kv_landed = {}, {}
    for j in range(n_blocks):
        issue = 0.0 if j < stages else released[j - stages]  # the producer waits for a free slot
        kv_landed[j] = (issue + load_latency, issue + load_latency + 256)  # (K_j, V_j)
        rows["producer warp\n(K/V in flight,\none lane per slot)"].append((issue, kv_landed[j][1], f"K{j} V{j}"))
        for gemm_kind in ("QK", "PV"):
            for w in (0, 1):  # the turn alternates: WG1, WG2, WG1, WG2, ...
                t_issue = max(ready[w], kv_landed[j][gemm_kind == "PV"], last_issue)
                start = max(t_issue, tc_free)
                tc_free = end = start + gemm
                last_issue = t_issue
                rows["tensor cores"].append((start, end, f"{gemm_kind}{j}|{w}"))
                rows[f"consumer WG {w + 1}"].append((t_issue, end, "wait"))
                if gemm_kind == "QK":  # softmax on the result; the two never share MUFU
                    s0 = max(end, mufu_free)
                    mufu_free = ready[w] = s0 + softmax
                    rows[f"consumer WG {w + 1}"].append((s0, s0 + softmax, "softmax"))
                else:
                    ready[w] = end
                    released[j] = end
    return rows, gemm, softmax


STAGES = 3
fig, axes = plt.subplots(2, 1, figsize=(12, 6.2))
for ax, d in zip(axes, (128, 64)):
    rows, gemm, softmax = pingpong(d, stages=STAGES)
    names = list(rows)
    for yi, name in enumerate(names):
        for s, e, lab in rows[name]:
            if name.startswith("tensor"):
                w = int(lab[-1])
                ax.broken_barh([(s, e - s)], (yi - 0.35, 0.7), color=("C0", "C1")[w], alpha=0.5 if "PV" in lab else 0.9)
                ax.text((s + e) / 2, yi, lab.split("|")[0], ha="center", va="center", fontsize=7)
            elif name.startswith("producer"):
                lane = int(lab.split()[0][1:]) % STAGES
                y0 = yi - 0.4 + lane * 0.27
                ax.broken_barh([(s, e - s)], (y0, 0.24), color="0.65")
                ax.text(s + 15, y0 + 0.12, lab, va="center", fontsize=6)
            elif lab == "softmax":
                ax.broken_barh([(s, e - s)], (yi - 0.35, 0.7), color="C3")
                ax.text((s + e) / 2, yi, "exp", ha="center", va="center", fontsize=7, color="w")
            else:  # its own GEMM issued, waiting in wait_group(0)
                ax.broken_barh([(s, e - s)], (yi - 0.1, 0.2), color=("C0", "C1")[int(name[-1]) - 1], alpha=0.35)
    busy = sum(e - s for s, e, _ in rows["tensor cores"])
    span = max(e for s, e, _ in rows["tensor cores"]) - min(s for s, e, _ in rows["tensor cores"])
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_title(f"d = {d}: one GEMM = {gemm:.0f} clk, one softmax = {softmax:.0f} clk on MUFU → "
                 f"tensor cores busy {busy / span:.0%} of the time", fontsize=9)
handles = [plt.Rectangle((0, 0), 1, 1, color=c, alpha=a) for c, a in
           [("C0", 0.9), ("C1", 0.9), ("C0", 0.5), ("C3", 1), ("C0", 0.35), ("0.65", 1)]]
fig.legend(handles, ["QK^T of WG 1", "QK^T of WG 2", "PV (lighter)", "exp2 of a softmax (MUFU)",
                     "thin: own GEMM issued, waiting (wait_group)", "TMA load of K_j, V_j"],
           fontsize=8, loc="lower center", ncol=6)
axes[-1].set_xlabel("clock cycles (schematic: roofline durations, no FP32 work, 600-clk loads)")
fig.suptitle("step 3, producer warp + 2 consumer warpgroups in ping-pong — SCHEMATIC derived from the kernel's "
             "structure, not measured", fontsize=10)
plt.tight_layout(rect=(0, 0.04, 1, 1))
plt.show()

# %% [markdown]
# Read the top panel left to right: WG 1 issues `QK0` and hands the turn over; WG 2's `QK0`
# queues behind it on the tensor cores while WG 1 exponentiates; WG 1's `PV0` then runs while
# WG 2 exponentiates, and so on. At `d = 128` each softmax fits under the other warpgroup's GEMM,
# so the tensor cores never wait. At `d = 64` the GEMMs are half as long, the softmax is not, and
# the tensor cores idle: the 64/d co-bound of the roofline, now as a picture. (The picture is the
# plain ping-pong: step 3 also pairs each `QK` with the previous tile's `PV` in one turn, so a
# warpgroup's softmax hides under its own `PV` as well.)
#
# ## Step 4's softmax, compiled: the default share of emulated exponentials is 0 on Hopper
# The FA4 softmax has two knobs, held in one `SoftmaxPolicy` that the Hopper and Blackwell kernels
# share: `tau` (conditional rescaling) and `emulation_fraction` (the share of exponentials computed
# by stage 2's polynomial on the FMA pipe). We compile the production kernel here with its default
# policy and with a quarter of the exponentials emulated, to see the polynomial appear in the SASS
# (`FADD.RM` is its floor) and `MUFU.EX2` shrink. On a Hopper GPU the cell also runs the kernel
# against the stage-0 oracle with FA4's tolerance rule.

# %%
from stage3_fwd_kernel import hopper, host_io, runner, sass_report, softmax_policy

keys = ["threads", "registers", "smem_bytes", "spill_stores", "HGMMA", "MUFU.EX2", "FADD.RM", "VOTE.ANY", "UTMALDG"]
W = 13
reports = {
    f"default {hopper.DEFAULT_POLICY.describe()}": hopper.compile_only("bf16", 128, 128, causal=True).report,
    "emulation_fraction=0.25": hopper.compile_only("bf16", 128, 128, causal=True, emulation_fraction=0.25).report,
}
print(f"arch {host_io.ARCH}, bf16, d = 128, causal (static SASS instruction counts)")
print(f"{'':<26}" + "".join(f"{k:>{W}}" for k in keys))
for name, rep in reports.items():
    print(f"{name[:25]:<26}" + "".join(f"{rep.get(k)!s:>{W}}" for k in keys))
default, emulated = reports.values()
assert default["spill_stores"] == 0 and default["registers"] * default["threads"] <= 65536
assert emulated["FADD.RM"] > default["FADD.RM"] and emulated["MUFU.EX2"] < default["MUFU.EX2"]
def blackwell_emulation_default():
    """The share the Blackwell forward's config emulates unless told otherwise (its own default)."""
    import inspect

    from stage3_fwd_kernel import blackwell_config
    return inspect.signature(blackwell_config.blackwell_fwd_config).parameters["emulation_fraction"].default


print(f"\nHopper default share emulated: {softmax_policy.HOPPER_EMULATION_FRACTION} "
      f"(the policy's own default, the paper's upper end: {softmax_policy.DEFAULT_EMULATION_FRACTION}; the "
      f"Blackwell forward configures {blackwell_emulation_default()})")
assert hopper.DEFAULT_POLICY.emulation_fraction == softmax_policy.HOPPER_EMULATION_FRACTION == 0

if runner.hopper_gpu_available():
    import torch

    from stage0_reference.torch_reference import assert_fa4_close, attention_ref

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 2048, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    out, lse = hopper.attention_forward(q, k, v, causal=True)
    (ref_o, ref_lse), (base_o, base_lse) = attention_ref(q, k, v, causal=True), attention_ref(q, k, v, causal=True, upcast=False)
    print("out: max error %.2e <= bound %.2e" % assert_fa4_close("out", out, ref_o, base_o))
    print("lse: max error %.2e <= bound %.2e" % assert_fa4_close("lse", lse, ref_lse, base_lse))
    print(hopper.run(batch=2, seqlen_q=4096, heads=16, causal=True, verbose=False)["tflops"], "TFLOP/s (this GPU)")
else:
    print("no Hopper GPU here: compiled only. The H100 results below are committed JSON.")

# %% [markdown]
# Why 0 on Hopper? The roofline says that at `d = 128` the tensor cores, not MUFU, bound the tile,
# so moving exponentials to the FMA pipe can only add instructions; at `d = 64` MUFU and the
# tensor cores tie, which is where emulation could pay. Stage 2 measured that a mix raises the rate
# of a *pure* exp2 loop, but inside this kernel the FMA pipe and the issue slots are already busy
# with the scaling, max, sum and 16-bit conversions. Paired rounds against the official kernel,
# 1 to 3 of every 16 exponentials emulated (`benchmarks/results/ab_fwd_h100_emu_sweep_d{64,128}.json`):

# %%
sweep = []
for d in (64, 128):
    doc = json.loads((RESULTS / f"ab_fwd_h100_emu_sweep_d{d}.json").read_text())
    for row in doc["results"]:
        if row["impl"] == "official":
            continue
        frac = float(row["impl"].split("emulation_fraction=")[1]) if "~" in row["impl"] else 0.0
        sweep.append((d, row["causal"], row["seqlen"], frac, row["ratio_median"]))
fig, axes = plt.subplots(1, 2, figsize=(10, 3.4), sharey=True)
for ax, d in zip(axes, (64, 128)):
    for causal in (False, True):
        for s, marker in ((4096, "o"), (16384, "s")):
            pts = sorted((f, r) for dd, c, ss, f, r in sweep if (dd, c, ss) == (d, causal, s))
            ax.plot([f * 16 for f, _ in pts], [r for _, r in pts], marker=marker, ls="-" if causal else "--",
                    label=f"{'causal' if causal else 'non-causal'} {s // 1024}k")
    ax.set_title(f"d = {d}, H100 (paired rounds)")
    ax.set_xlabel("exponentials emulated, of every 16")
    ax.set_xticks([0, 1, 2, 3])
axes[0].set_ylabel("speed / official FA4 (median)")
axes[0].legend(fontsize=8)
plt.tight_layout()
plt.show()
for causal in (False, True):  # every share loses at d = 64, more loses more; two in 16 loses at d = 128
    for s in (4096, 16384):
        d64 = [r for f, r in sorted((f, r) for dd, c, ss, f, r in sweep if (dd, c, ss) == (64, causal, s))]
        assert d64 == sorted(d64, reverse=True), d64
        d128 = dict((f, r) for dd, c, ss, f, r in sweep if (dd, c, ss) == (128, causal, s))
        assert d128[0.125] < d128[0.0] and d128[0.0625] < 1.01 * d128[0.0], d128

# %% [markdown]
# Every share is slower than none on this kernel, so the Hopper default is `emulation_fraction = 0`
# (`softmax_policy.HOPPER_EMULATION_FRACTION`). The technique stays available and tested, and the
# Blackwell kernel, whose tie between MMA and exp is at `d = 128`, uses the paper's share.
#
# ## Measured on an H100: the production kernel and the ladder against peers
# `benchmarks/bench_fwd.py` times our kernels and the peers in the same process (bf16, 32k tokens
# per batch, hidden 2048, median of `triton.testing.do_bench`). Each implementation is taken from the
# newest committed run that measured it, and every ratio to the official FA4 uses the official
# kernel of the *same* run. In these files the production kernel is named after the ladder step it
# was built in (`ours:step4_fa4_softmax`).

# %%
FWD_RUNS = ["fwd_h100_run1_steps1-3_quick", "fwd_h100_run5_steps3-4_quick",  # the ladder, quick lengths
            "fwd_h100_run7_d64_variants", "fwd_h100_run12_v_wait"]                # d = 64 variants; a full sweep
runs = {stem: json.loads((RESULTS / f"{stem}.json").read_text()) for stem in FWD_RUNS}  # oldest first
table = {}  # (impl, d, causal, seqlen) -> (tflops, run); later runs overwrite earlier ones
for stem, doc in runs.items():
    for r in doc["results"]:
        if r.get("tflops"):
            table[(r["impl"], r["head_dim"], r["causal"], r["seqlen"])] = (r["tflops"], stem)

FA4, PEERS = "flash-attn-4 (official)", ["flash-attn-4 (official)", "cuDNN (SDPA)", "FA2 (SDPA)"]
PROD = "ours:step4_fa4_softmax"
OURS = {"ours:step1_wgmma": "step 1 wgmma", "ours:step2_tma": "step 2 TMA", "ours:step3_warpspec": "step 3 ping-pong",
        "variant:tau=0,emu=0": "production, tau=0", "variant:tau=8,emu=0": "production, tau=8",
        PROD: "production (default)"}


def tflops(impl, d, causal, s, run=None):
    """TFLOP/s of impl; with run=..., only from that run (for same-run ratios)."""
    if run is None:
        return table.get((impl, d, causal, s), (None,))[0]
    hit = [r for r in runs[run]["results"] if (r["impl"], r["head_dim"], r["causal"], r["seqlen"]) == (impl, d, causal, s)]
    return hit[0].get("tflops") if hit else None


prod_runs = [stem for stem, doc in runs.items() if any(r["impl"] == PROD for r in doc["results"])]
sweep_run = prod_runs[-1]
rows = [r for r in runs[sweep_run]["results"] if r.get("tflops")]
print(f"{sweep_run}.json: {runs[sweep_run]['device']}, commit {runs[sweep_run]['git_commit']}\n    {runs[sweep_run]['command']}")
dims = sorted({(r["head_dim"], r["head_dim_v"]) for r in rows})
fig, axes = plt.subplots(2, len(dims), figsize=(3.3 * len(dims), 6), sharex=True, squeeze=False)
for col, (d, dv) in enumerate(dims):
    for row, causal in enumerate((False, True)):
        ax = axes[row, col]
        for impl, style in zip([PROD] + PEERS, ["C3o-", "k--", "k:", "k-."]):
            pts = sorted((r["seqlen"], r["tflops"]) for r in rows
                         if (r["impl"], r["head_dim"], r["head_dim_v"], r["causal"]) == (impl, d, dv, causal))
            if pts:
                ax.plot(*zip(*pts), style, label=OURS.get(impl, impl), ms=4)
        ax.set_xscale("log", base=2)
        sl = sorted({r["seqlen"] for r in rows})
        ax.set_xticks(sl, [f"{x // 1024}k" for x in sl], fontsize=8)
        ax.set_title(f"d = {d}{'' if d == dv else f'/{dv}'}, {'causal' if causal else 'non-causal'}", fontsize=9)
        if col == 0:
            ax.set_ylabel("TFLOP/s")
fig.legend(*axes[0, 0].get_legend_handles_labels(), loc="lower center", ncol=4, fontsize=8)
fig.suptitle(f"forward, bf16, {runs[sweep_run]['device']}", fontsize=10)
plt.tight_layout(rect=(0, 0.05, 1, 1))
plt.show()

# %%
ladder_lens = sorted({k[3] for k in table if k[0] in OURS and k[0] != PROD and k[1] == 128})
fig, axes = plt.subplots(1, len(ladder_lens), figsize=(6 * len(ladder_lens), 3.8), sharey=True, squeeze=False)
labels = [impl for impl in OURS if table.get((impl, 128, False, max(ladder_lens)))] + PEERS[1:]
for ax, s in zip(axes[0], ladder_lens):
    for j, causal in enumerate((False, True)):
        ratios = []
        for impl in labels:
            hit = table.get((impl, 128, causal, s))
            ratios.append(hit[0] / tflops(FA4, 128, causal, s, run=hit[1]) if hit else 0)  # same-run FA4
        bars = ax.bar(np.arange(len(labels)) + (j - 0.5) * 0.4, ratios, 0.4, label="causal" if causal else "non-causal")
        ax.bar_label(bars, fmt="%.2f", fontsize=6)
    ax.axhline(1, color="k", lw=0.6)
    ax.set_xticks(np.arange(len(labels)), [OURS.get(impl, impl) for impl in labels], rotation=25, ha="right",
                  fontsize=7)
    ax.set_title(f"d = 128, seqlen {s // 1024}k", fontsize=10)
axes[0, 0].set_ylabel("TFLOP/s / official FA4 (same run)")
axes[0, 0].legend(fontsize=8, loc="upper left")
plt.tight_layout()
plt.show()
gain = {(d, c, s): tflops("variant:tau=8,emu=0", d, c, s) / tflops("variant:tau=0,emu=0", d, c, s) - 1
        for d in (64, 128) for c in (False, True) for s in ladder_lens
        if tflops("variant:tau=8,emu=0", d, c, s) and tflops("variant:tau=0,emu=0", d, c, s)}
print("conditional rescaling (tau = 8 against tau = 0, both without emulation):",
      ", ".join(f"d={d} {'causal' if c else 'non-causal'} {s // 1024}k {g:+.1%}" for (d, c, s), g in gain.items()))
assert all(g > 0 for g in gain.values())

# %% [markdown]
# Step 2's TMA pipeline alone changes little: one warpgroup still alternates between the tensor cores
# and MUFU. Step 3's ping-pong is the large step, as the schematic above predicts. The two `tau` bars
# come from an earlier build of the production kernel, measured in one quick run, so compare them with
# each other, and loosely: rows of a quick run differ by up to ~10% by noise alone. Conditional rescaling
# came out ahead there, as the paper predicts, because skipping the O rescale removes `dv / 2` multiplies
# per thread per tile, as many as its exponentials; paired rounds put the gain at 4-5% at d = 128
# non-causal, 0-2% causal, and a tie at d = 64 (docs/measurements.md, runs 59 and 61).
# What separates today's production kernel from step 4 is not inside the softmax: the sections below
# are the pieces it adds.
#
# ## Persistent CTAs: paying the per-CTA cost once per SM
# Time a kernel over a range of key lengths with one CTA per tile and fit
# `time per CTA = a + b x key blocks`: the fixed part `a` (launch, barrier set-up, the first Q and K
# loads, the last P V and the O store) comes out at about two key-block steps at `d = 128` and three
# at `d = 64`. A persistent kernel launches one CTA per SM and walks the tiles, so `a` is paid once
# per SM; the producer carries the K/V ring position and Q's barrier phase from tile to tile.
# Causal tiles differ in length, so there the next tile is taken from an atomic counter, longest
# first (tutorial 05 shows why a fixed hand-out fails there). The arithmetic, 32k tokens per batch:

# %%
for d, fixed_steps in ((64, 3), (128, 2)):
    for s in (1024, 4096, 16384):
        blocks = s // 128  # key blocks of a non-causal query tile
        print(f"d = {d:>3}, {s // 1024:>2}k keys: per-CTA fixed cost = {fixed_steps / (fixed_steps + blocks):5.1%} "
              f"of a one-CTA-per-tile kernel's time")

# %% [markdown]
# ## The last wave: splitting the tail tiles along the keys
# A persistent kernel hands equal tiles to P CTAs, so T tiles take `ceil(T / P)` tile-times however
# few tiles the last wave holds. The benchmark's non-causal d = 128 calls (32k tokens, 16 heads) have
# 4096 query tiles at every length: 31 waves of the H100's 132 SMs and then 4 tiles, while 128 SMs
# wait. The production kernel cuts those last R tiles along the keys into R x S chunks that the idle
# CTAs walk; each chunk leaves its O and lse in fp32, and a small kernel merges them with
# `O = sum_j exp(lse_j - lse) O_j`, `lse = log sum_j exp(lse_j)`: the rescaling the online softmax
# does between key blocks. First the arithmetic, then the merge checked against stage 0:

# %%
import math

from stage0_reference import attention_forward as attention_ref64

SMS = 132
for s in (4096, 8192, 16384):
    tiles = (s // 128) * 16 * (32768 // s)
    waves = tiles / SMS
    tail = tiles - SMS * (tiles // SMS)
    chunks = min(SMS // tail, s // 128) if tail else 0  # chunks per tail tile: fill the SMs, >= 1 key block each
    print(f"d = 128, {s // 1024:>2}k: {tiles} tiles = {waves:5.2f} waves; the last wave: {tail} tiles on {SMS} SMs "
          f"({1 - tiles / (SMS * math.ceil(waves)):.1%} of the SM-time idle) -> up to {tail} x {chunks} chunks")

rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, n, 1, 64)) for n in (128, 1024, 1024))
ref_o, ref_lse = attention_ref64(q, k, v)
parts = [attention_ref64(q, k[:, j:j + 256], v[:, j:j + 256]) for j in range(0, 1024, 256)]  # 4 key chunks
lse_j = np.stack([p[1] for p in parts])                   # (chunks, B, H, Sq)
lse = np.log(np.exp(lse_j - lse_j.max(0)).sum(0)) + lse_j.max(0)
w = np.exp(lse_j - lse)                                   # each chunk's weight per row
o = sum(w[j].transpose(0, 2, 1)[..., None] * parts[j][0] for j in range(len(parts)))
print("merged 4 key chunks: max |O - O_ref| =", f"{np.abs(o - ref_o).max():.1e}", "| max |lse - lse_ref| =",
      f"{np.abs(lse - ref_lse).max():.1e}")
assert np.allclose(o, ref_o) and np.allclose(lse, ref_lse)
tail_runs = json.loads((RESULTS / "wave_tail_h100_run1.json").read_text())
for row in tail_runs["results"]:
    if row["head_dim"] == 128:
        print(f"measured before the split, d = 128 {row['seqlen'] // 1024:>2}k {row['impl']:>8}: time per tile x"
              f"{row['per_tile_ratio_median']:.3f} (an idle last wave predicts x{row['ideal_if_tail_is_idle']:.3f})")

# %% [markdown]
# The measured lines (`benchmarks/inspect/wave_tail.py`: each length timed next to a shape that fills
# whole waves) show both kernels losing about what an idle last wave predicts at 8k and 16k.
#
# ## d = 96: when P no longer fits in registers, it goes through shared memory
# Three consumer warpgroups (192 query rows) pay off at small head dims, but the register file is
# 65536 registers: with a 128-thread producer at 32 registers, each consumer thread gets 160. A
# consumer's 64 x `tn` tile holds S in fp32 (`tn / 2` registers a thread), P packed to 16 bits
# (`tn / 4`) and O in fp32 (`dv / 2`), plus the softmax's row state and addresses (about 30). At
# d = 64 that fits; at d = 96 it does not. Storing P to a shared-memory slab right after the
# exponentials frees its registers (P V then reads P by descriptor, like K and V), at the price of
# shared memory, a fence and a 128-thread barrier every key block. With P out of registers, 144 keys
# fit too: the official kernel's d = 96 tile. The arithmetic:

# %%
def consumer_registers(d, tn, p_in_registers):
    s, p, o = tn // 2, tn // 4 if p_in_registers else 0, d // 2
    return s, p, o, s + p + o + 30  # ~30: row max / sum, the rescale vote, addresses


for d, tn, p_reg in ((64, 128, True), (96, 128, True), (96, 128, False), (96, 144, False), (96, 144, True)):
    s, p, o, total = consumer_registers(d, tn, p_reg)
    print(f"d = {d}, {tn} keys, P in {'registers    ' if p_reg else 'shared memory'}: S {s} + P {p:>2} + O {o} "
          f"+ ~30 = {total:>3} of 160 {'fits' if total <= 160 else 'spills'}")
KIB = 1024
q_b, p_b, kv_stage = 192 * 96 * 2, 192 * 144 * 2, 144 * (96 + 96) * 2   # bytes: Q, P slabs, one K+V stage
print(f"shared memory, 192 x 144: Q {q_b // KIB} + P {p_b // KIB} + 2 K/V stages {2 * kv_stage // KIB} = "
      f"{(q_b + p_b + 2 * kv_stage) // KIB} KiB of 227, 199 with barriers and alignment (O reuses Q's buffer); "
      f"a persistent CTA's own O buffer would add {q_b // KIB}")

# %% [markdown]
# That last line is why this tile runs one CTA per tile: a persistent CTA stages O apart from Q so the
# next tile's Q can load during the epilogue, and beside 144-key stages O would have to go from
# registers. The measurement (an H200, paired rounds against the official kernel, non-causal d = 96):

# %%
tile_runs = json.loads((RESULTS / "ab_fwd_h200_d96_tile192_tn144.json").read_text())
names = {"fa4": "128 x 128, persistent (the old default)",
         "stage3_fwd_kernel.hopper~tile_m=192": "192 x 128, persistent",
         "stage3_fwd_kernel.hopper~tile_m=192~persistent=False": "192 x 128, one CTA per tile",
         "probe_tn~tile_m=192": "192 x 144, persistent",
         "probe_tn~tile_m=192~persistent=False": "192 x 144, one CTA per tile (the default now)"}
fig, ax = plt.subplots(figsize=(8, 3.2))
for impl, label in names.items():
    rows = sorted((r for r in tile_runs["results"] if r["impl"] == impl), key=lambda r: r["seqlen"])
    ax.plot([r["seqlen"] // 1024 for r in rows], [r["ratio_median"] for r in rows], marker="o", label=label)
ax.axhline(1.0, color="grey", lw=0.8)
ax.set(xscale="log", xticks=[1, 2, 4, 8, 16], xticklabels=["1k", "2k", "4k", "8k", "16k"], xlabel="keys",
       ylabel="official time / ours", title=f"d = 96 forward tiles, non-causal ({tile_runs['device']})")
ax.legend(fontsize=7)
plt.tight_layout()
plt.show()

# %% [markdown]
# Causal calls keep 128 x 128 below 8192 keys, where the smaller tile leads. From 8192 keys they take
# 192 x 144 too: the mask's registers spill 8 bytes of the kernel's entry, reloaded outside the key-block
# loop, and the tiles run in the grid's order (the LPT order's build spills inside the loop). On an H200,
# official time / ours at 8k / 16k: 1.03 / 1.04x, from 1.00 / 0.97x (docs/measurements.md, 2026-12-02,
# "long causal d = 96 calls on the 192 x 144 tile"). Code: `stage3_fwd_kernel/hopper/config.py`
# (`p_through_smem`, `default_tile_m`, `default_tile_n`, `grid_order_causal`) and `hopper/mainloop.py`
# (`publish_P`).
#
# ## Reading the hot loop: bookkeeping is instructions too
# Once the math is right, the key-block loop still holds instructions that are neither MMA nor
# softmax: which ring slot of K/V to read, which barrier phase to wait for, where the wgmma
# descriptors point. They are issued by the same warp schedulers as the exponentials.
#
# The slot of the i-th key block, `(i // stages) % 2` and `i % stages`, is the first example. On a
# signed `Int32`, C rounds a division toward zero and Python toward minus infinity, so the compiler
# must emit fix-ups for negative `i` (the `LEA.HI` opcodes) even though `i` is never negative:

# %%
for i in (-5, -4, 5):
    c_quotient = int(i / 4)  # C's signed division truncates toward zero
    print(f"i = {i:>2}: Python i // 4 = {i // 4:>2}, C i / 4 = {c_quotient:>2}, C i % 4 = {i - 4 * c_quotient:>2}")

# %% [markdown]
# The production kernel carries the slot from block to block instead (`PipelineState.advance`: an
# add, a compare and two selects) and divides as unsigned where it must (`intdiv.ring_slot`). The
# row sums start at their first value rather than at `0.0 + p` (a compiler may not drop an add of
# +0.0, since -0.0 + 0.0 is +0.0; P is never negative, so the bits are the same).
# `sass_report.key_block_loop` finds the unmasked key-block loop in the SASS (the shortest loop
# with both wgmma and exp2). Here is the production loop at d = 64, compiled on this machine:

# %%
import collections

comp = hopper.compile_only("bf16", 64, 64, causal=True)
hot = sass_report.key_block_loop(comp.sass)
kinds = collections.Counter(o.split(".")[0] for o in hot)
uniform = sum(n for op, n in kinds.items() if op.startswith("U"))
print(f"d = 64 causal, hot loop: {len(hot)} instructions, {uniform} uniform; HGMMA {kinds['HGMMA']}, "
      f"MUFU {kinds['MUFU']}, FADD {kinds['FADD']}, sign fix-ups (LEA.HI) "
      f"{sum(o.startswith(('LEA.HI', 'ULEA.HI')) for o in hot)}")

# %% [markdown]
# ### Descriptors built once
# A wgmma descriptor is a 64-bit word that tells wgmma where an operand sits in shared memory and how
# it is laid out: the start address >> 4, a leading and a stride byte offset, and the swizzle mode.
# `cute.gemm` computes it where the wgmma is issued, so ptxas would re-derive Q's, K's and V's from the
# shared-memory base in every key block. The production kernel builds them once per tile
# (`wgmma_desc.py`), passes them through a warp shuffle so that ptxas keeps them in uniform registers,
# and adds only `stage * stage_step` per block. The fixed fields are the ones `cute.gemm` ORs in:

# %%
from stage3_fwd_kernel import wgmma_desc

for d, dv, tn in ((64, 64, 128), (128, 128, 128), (256, 256, 64)):
    qk = wgmma_desc.fixed_fields(d, tn, 16, mn_major=False)
    v_fields = wgmma_desc.fixed_fields(dv, tn, 16, mn_major=True)
    print(f"d = {d:>3}: Q / K fields {qk:#018x} (swizzle {wgmma_desc.swizzle_bytes(d, 16)} B), V fields {v_fields:#018x}")
print("descriptor rebuilt in the d = 64 loop above:", "USHF.R.U32.HI" in hot)

# %% [markdown]
# ### A vote that is one compare per row
# Each block asks "did some row's max grow by more than tau?". Written as `(m_new - m) * scale > tau`
# it costs a subtract and a multiply per row, plus the exponent's bias `m * scale` (guarded for
# `m = -inf`). But m moves only when the warp votes to rescale, which after the first few blocks is
# rare. So the production kernel keeps the limit `m + tau / scale` and the bias beside m, updated
# only inside the rescale branch: between the row maxima's last shuffle and the vote there is only
# the final max and the compare, and the only `FSEL`s are the branch's two guards:

# %%
vote = hot.index("VOTE.ANY")
last_shuffle = max(i for i, o in enumerate(hot[:vote]) if o.startswith("SHFL"))
print("between the last row-max shuffle and VOTE.ANY:", [o for o in hot[last_shuffle + 1:vote] if o[0] == "F"])
print("FSEL in the loop:", hot.count("FSEL"))

# %% [markdown]
# ### P packed between the exponentials
# Every key-block step waits on the tensor cores twice: for `S_i` (`wait_group(1)`) before its
# softmax, and for the previous block's `P V` (`wait_group(0)`) before it touches O and P's registers
# again. P's 16-bit packs (`F2FP`) write registers that the previous `P V` still reads, so they must
# come after that second wait. Left to the compiler, a conversion sinks to its first use and all 32
# packs run in a row at the end of the step, where the next wgmma waits for them. The production
# kernel packs each pair with a volatile `cvt` (the same `F2FP` instruction, so the same bits) right
# after the wait, so the packs fill the gaps between the remaining exponentials. Below, the loop one
# letter per instruction: `e` exp2, `p` a pack, `u` a multiply, `a` an add, `f` an FMA, `.` anything
# else; `[W]` starts a line at each wgmma wait and `[B]` at each branch.

# %%
LETTERS = {"MUFU": "e", "F2FP": "p", "FMUL": "u", "FADD": "a", "FFMA": "f"}
lines, line = [], ""
for op in hot:
    if op.startswith(("WARPGROUP.DEPBAR", "BRA")):
        lines.append(line)
        line = "[W]" if op.startswith("WARPGROUP") else "[B]"
    line += LETTERS.get(op.split(".")[0], ".")
lines.append(line)
for text in lines:
    if text:
        print(text if len(text) <= 110 else text[:70] + " ... " + text[-35:])
after_wait = max((t for t in lines if t.startswith("[W]")), key=lambda t: t.count("p"))
packs_before_last_exp = after_wait[:after_wait.rfind("e")].count("p")
print(f"\n{packs_before_last_exp} of {after_wait.count('p')} packs sit before the last exponential of their line")

# %% [markdown]
# Timed in paired rounds on an H100 against the build that packed P at the end of the step
# (`benchmarks/results/ab_fwd_h100_run70_pfirst.json`), packing between the exponentials is faster
# at every point up to (192, 128) and ties at d = 256, whose 64-key tiles have half the exponentials
# per step:

# %%
doc = json.loads((RESULTS / "ab_fwd_h100_run70_pfirst.json").read_text())
ms = {(r["impl"], r["head_dim"], r["causal"], r["seqlen"]): np.array(r["ms_rounds"]) for r in doc["results"]}
packed_late = next(impl for impl, *_ in ms if impl not in ("official",) and not impl.startswith("fwd_abl"))
fig, ax = plt.subplots(figsize=(10, 3.4))
ticks, medians = [], {}
for k, (label, d) in enumerate({"d = 64": 64, "d = 128": 128, "(192, 128)": 192, "d = 256": 256}.items()):
    for j, (causal, s) in enumerate([(c, s) for c in (False, True) for s in (4096, 8192, 16384)]):
        r = ms[(packed_late, d, causal, s)] / ms[("fwd_abl_pfirstall", d, causal, s)]  # per round
        x = 7 * k + j
        ax.scatter(np.full(len(r), x), r, s=10, alpha=0.5, color=f"C{int(causal)}",
                   label=("causal" if causal else "non-causal") if k == 0 and s == 4096 else None)
        ax.plot([x - 0.3, x + 0.3], [np.median(r)] * 2, color=f"C{int(causal)}", lw=2)
        medians.setdefault(label, []).append(np.median(r))
    ticks.append((7 * k + 2.5, label))
ax.set_xticks(*zip(*ticks))
ax.axhline(1.0, color="gray", lw=0.8)
ax.set_ylabel("time, packed late / packed between")
ax.set_title("P packed between the exponentials, H100: one dot per paired round (4k, 8k, 16k each)", fontsize=10)
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()
assert min(medians["(192, 128)"]) > 1.03 and min(medians["d = 128"]) > 1.0

# %% [markdown]
# ## The Blackwell pipeline
# On Blackwell (sm_100a) the MMA accumulators leave the register file for **tensor memory**
# (TMEM: 128 lanes x 512 columns of 32 bits per SM), a 128 x 128 MMA is one instruction issued by
# one thread, and the paper's forward (§3.1.2) assigns: one MMA warp, one TMA load warp, **two
# softmax warpgroups** (one per 128-row Q tile, a whole row per thread: no shuffles), and a
# **correction warpgroup** that rescales O in TMEM off the softmax's critical path. The paper:
# "two tiles of S that overlap with P ... It also leaves some tensor memory to communicate rescale
# statistics to the correction warpgroup." `blackwell_config.py` is that plan in plain Python;
# below it is printed and drawn.

# %%
from stage3_fwd_kernel.blackwell_config import SMEM_CAPACITY, TMEM_COLUMNS, blackwell_fwd_config

cfg = blackwell_fwd_config(128, 128, "bf16", causal=False)
print(cfg.summary(), "\n")
print(cfg.tmem.table(), "\n")
for role, warps, job in cfg.roles.describe():
    print(f"  {role:<14} {warps:<11} {job}")
print("\nregisters per thread (setmaxnreg): softmax", cfg.regs.softmax, "| correction", cfg.regs.correction,
      "| other", cfg.regs.other, f"→ 128 x (2 x {cfg.regs.softmax} + {cfg.regs.correction} + {cfg.regs.other})"
      f" = {cfg.regs.total}")

# %%
fig, (ax, ax2) = plt.subplots(2, 1, figsize=(11, 5), gridspec_kw={"height_ratios": [1.2, 1]})
t = cfg.tmem
for i, (s0, o0) in enumerate(zip(t.s, t.o)):
    ax.broken_barh([(s0, t.s_cols)], (1, 0.8), color="C0", alpha=0.5)
    ax.text(s0 + t.s_cols / 2, 1.4, f"S_{i} = Q_{i} K^T (fp32)", ha="center", fontsize=8)
    ax.broken_barh([(o0, t.o_cols)], (1, 0.8), color="C2", alpha=0.6)
    ax.text(o0 + t.o_cols / 2, 1.4, f"O_{i} (fp32, whole kernel)", ha="center", fontsize=8)
    ax.broken_barh([(t.p[i], t.p_cols)], (0, 0.8), color="C1", alpha=0.8)
    ax.text(t.p[i] + t.p_cols / 2, 0.4, f"P_{i} (bf16 x 2)", ha="center", fontsize=8)
    ax.broken_barh([(t.scale[i], 1), (t.final[i], 2)], (0, 0.8), color="C3")
    ax.annotate(f"scale_{i}, row sum/max", (t.scale[i] + 1, 0.4), (t.scale[i] + 8, 0.4), fontsize=7, va="center",
                arrowprops={"arrowstyle": "->", "lw": 0.6})
ax.set_xlim(0, TMEM_COLUMNS)
ax.set_yticks([0.4, 1.4], ["aliases inside S", "accumulators"])
ax.set_xlabel("TMEM column (each column: 128 lanes = 128 query rows x 32 bit)")
ax.set_title(f"Blackwell forward, d = 128: {t.used} of {TMEM_COLUMNS} TMEM columns (plan, from blackwell_config)",
             fontsize=10)
configs = [(64, 64), (128, 128), (192, 128)]
for yi, (d, dv) in enumerate(configs):
    sm = blackwell_fwd_config(d, dv, "bf16", causal=False).smem
    left = 0
    for part, nbytes, color in [("header", sm.header, "0.5"), ("sQ", sm.q, "C0"),
                                (f"K/V ring {sm.kv_stages}x", sm.kv, "C1"), ("sO", sm.o, "C2")]:
        ax2.barh(yi, nbytes / 1024, left=left / 1024, color=color)
        if nbytes > 8 * 1024:
            ax2.text((left + nbytes / 2) / 1024, yi, part, ha="center", va="center", fontsize=8)
        left += nbytes
    ax2.text(left / 1024 + 2, yi, f"{left / 1024:.0f} KB" + (" (sO over sQ)" if sm.o_overlaps_q else ""),
             va="center", fontsize=8)
ax2.axvline(SMEM_CAPACITY / 1024, color="r", lw=1)
ax2.text(SMEM_CAPACITY / 1024, -0.5, f" {SMEM_CAPACITY / 1024:.0f} KB opt-in limit", color="r", fontsize=8)
ax2.set_yticks(range(len(configs)), [f"d = {d}/{dv}" for d, dv in configs])
ax2.set_xlim(0, 300)
ax2.set_ylim(len(configs) - 0.5, -0.85)  # top to bottom, room for the limit's label
ax2.set_xlabel("shared memory per CTA (KB)")
ax2.set_title("SMEM plan per head dim (header + Q tiles + K/V ring + O staging)", fontsize=10)
plt.tight_layout()
plt.show()
try:  # the plan refuses what does not fit, naming the budget
    blackwell_fwd_config(256, 256, "bf16", causal=False)
except ValueError as exc:
    print("d = 256:", exc)

# %% [markdown]
# Compare with Hopper: there, each consumer thread held S (64 registers) and O (64 registers at
# `d = 128`) itself, and rescaling O sat on the softmax's critical path. On Blackwell, S and O live
# in TMEM; P overwrites the upper half of the S it came from (the MMA warp issues in order, so
# `O += P V` reads P before the next `S = Q K^T` lands there), two S tiles let the pipeline start
# with two QK^T back to back, and the correction warpgroup rescales O while the softmax moves on.
# At `d = 128` the plan uses every one of the 512 columns, which is why `d = 256` needs another
# plan.
#
# ## A forward timeline with the correction warpgroup at work (a model)
# The paper: "since we transfer P via tensor memory rather than register file, we can decouple the
# rescaling of the output to a separate 'correction' warpgroup and thus take it out of the critical
# path." The model below replays the kernel's order with the roofline's costs at `d = 128` (B200):
# per key block the MMA warp issues `PV_0(j-1), S_0(j), PV_1(j-1), S_1(j)`; softmax warpgroup `i`
# waits for `S_i(j)`, finds the row max and votes (an assumed 150 clocks), posts the rescale factor,
# then takes its turn on MUFU for 1024 clocks (the two warpgroups' exponentials never overlap);
# `PV_i(j)` needs 3/4 of P (next section) and O_i rescaled. The rescale (an assumed 250 clocks to
# read, scale and write O_i's 128 columns of TMEM) is charged every block: `tau = 0`, the worst
# case. Top: a correction warpgroup does it. Bottom: the softmax warpgroup does it before its
# exponentials, as a Hopper consumer must. Model clocks, not measurements.

# %%
def blackwell_forward_timeline(n_blocks=5, d=128, correction_wg=True, pre=150, rescale=250):
    """Replay the Blackwell forward's per-block order; returns ({row: [(start, end, label, color)]}, end)."""
    c = forward_tile_cycles(128, 128, d, B200)
    gemm, exp = c.mma / 2, c.exp  # one 128 x 128 x d GEMM; one tile's exponentials
    rows = {"tensor cores": [], "softmax WG 0": [], "softmax WG 1": [], "correction WG": []}
    tc = mufu = corr = 0.0
    sm_free, pv_done, p34, pfull, o_ready = [0.0, 0.0], {}, {}, {}, {}
    program = [("S", 0, 0), ("S", 1, 0)]
    for j in range(1, n_blocks):
        program += [("PV", 0, j - 1), ("S", 0, j), ("PV", 1, j - 1), ("S", 1, j)]
    program += [("PV", 0, n_blocks - 1), ("PV", 1, n_blocks - 1)]
    for kind, i, j in program:
        if kind == "S":
            start, tc = tc, tc + gemm
            rows["tensor cores"].append((start, tc, f"S{i}", f"C{i}"))
            t0 = max(tc, sm_free[i])  # softmax i(j): row max + vote, then the rescale factor is posted
            rows[f"softmax WG {i}"].append((t0, t0 + pre, "max", "0.6"))
            ready = t0 + pre
            if j > 0:  # O_i must be final after PV_i(j-1) before it is rescaled
                if correction_wg:
                    cs = max(ready, corr, pv_done[(i, j - 1)])
                    corr = o_ready[(i, j)] = cs + rescale
                    rows["correction WG"].append((cs, corr, f"O{i}", "C2"))
                else:
                    cs = max(ready, pv_done[(i, j - 1)])
                    rows[f"softmax WG {i}"].append((cs, cs + rescale, f"O{i}", "C2"))
                    ready = o_ready[(i, j)] = cs + rescale
            else:
                o_ready[(i, j)] = 0.0
            es = max(ready, mufu)
            mufu = sm_free[i] = pfull[(i, j)] = es + exp
            p34[(i, j)] = es + 0.75 * exp
            rows[f"softmax WG {i}"].append((es, mufu, "exp2", "C3"))
        else:  # O_i += P_i V: 3/4 of the K steps once 3/4 of P is in TMEM, the rest after the last quarter
            start = max(tc, p34[(i, j)], o_ready[(i, j)])
            mid = start + 0.75 * gemm
            end = max(mid, pfull[(i, j)]) + 0.25 * gemm
            rows["tensor cores"] += [(start, mid, f"PV{i}", f"C{i}"), (end - 0.25 * gemm, end, "", f"C{i}")]
            tc = pv_done[(i, j)] = end
    return rows, tc


fig, axes = plt.subplots(2, 1, figsize=(12, 5.4), sharex=True)
busy_share = {}
for ax, with_corr in zip(axes, (True, False)):
    rows, end = blackwell_forward_timeline(correction_wg=with_corr)
    for yi, (name, bars) in enumerate(rows.items()):
        for s, e, lab, color in bars:
            ax.broken_barh([(s, e - s)], (yi - 0.35, 0.7), color=color, alpha=0.45 if lab.startswith("PV") or
                           (name.startswith("tensor") and not lab) else 0.85, edgecolor="k", lw=0.3)
            if lab and e - s > 200:
                ax.text((s + e) / 2, yi, lab, ha="center", va="center", fontsize=7)
    busy = sum(e - s for s, e, _, _ in rows["tensor cores"]) / end
    busy_share[with_corr] = busy
    ax.set_yticks(range(len(rows)), list(rows), fontsize=8)
    ax.invert_yaxis()
    who = "a correction warpgroup rescales O" if with_corr else "each softmax warpgroup rescales its own O"
    ax.set_title(f"{who}: {end:.0f} clk for 5 key blocks of two Q tiles, tensor cores busy {busy:.0%}", fontsize=9)
axes[-1].set_xlabel("B200 clocks (model: roofline GEMM and exp2 costs, assumed 150 clk max/vote, 250 clk O rescale)")
plt.tight_layout()
plt.show()
assert busy_share[True] > busy_share[False]

# %% [markdown]
# With the correction warpgroup (top) each softmax warpgroup goes from its vote straight to its
# exponentials, and the two MUFU turns follow each other with no gap: the exp unit, the binding
# resource at `d = 128` on Blackwell, stays busy. Without it (bottom) every rescale sits between a
# vote and its exponentials, and also waits for the previous `P V`, so MUFU idles and the tensor
# cores with it. Conditional rescaling makes the rescale rare after the first blocks, which narrows
# the gap; the correction warpgroup removes it.
#
# ## Storing P in two stages: 3/4, then 1/4
# A softmax thread holds a whole row of S: 128 fp32 registers. If it converted the whole row and then
# stored it, the 64 registers of packed P would be live next to the 128 of S. The paper: "we stage out
# storing P: The first three quarters are stored once (and trigger the corresponding MMA operations),
# and the last quarter is stored separately." The thread stores the row's packed P a quarter of the
# keys at a time, in key order; after the third store it arrives on `p_full` and the MMA warp may
# start `O += P V` on the K steps that read only those keys (a tcgen05 f16 MMA has K = 16, so 8
# steps per 128 keys). The last quarter arrives on `p_full_2`, and the MMA warp issues the rest:

# %%
from stage3_fwd_kernel import blackwell_load_mma  # the load and MMA warps of blackwell_fwd's kernel class


def source_of(module, qualname):
    """The source of `Class.method` or `function` in a module, read with ast (decorators included)."""
    path = pathlib.Path(module.__file__)
    tree, node = ast.parse(path.read_text()), None
    for part in qualname.split("."):
        body = tree.body if node is None else node.body
        node = next(n for n in body if getattr(n, "name", None) == part)
    lines = path.read_text().splitlines()
    return "\n".join(lines[node.decorator_list[0].lineno - 1 if node.decorator_list else node.lineno - 1:node.end_lineno])


cfg = blackwell_fwd_config(128, 128, "bf16", causal=False)
keys_per_store = cfg.tile_n // cfg.p_store_chunks
first_keys = keys_per_store * cfg.p_first_chunks
print(f"tile_n = {cfg.tile_n} keys per row -> {cfg.p_store_chunks} stores of {keys_per_store} keys "
      f"({keys_per_store // 2} TMEM columns of two 16-bit values each)")
print(f"after store {cfg.p_first_chunks}: keys [0, {first_keys}) are in TMEM -> the MMA warp issues K steps "
      f"0..{cfg.pv_k_blocks_first - 1} of {cfg.pv_k_blocks}; after store {cfg.p_store_chunks}: keys "
      f"[{first_keys}, {cfg.tile_n}) -> K steps {cfg.pv_k_blocks_first}..{cfg.pv_k_blocks - 1}\n")
assert cfg.pv_k_blocks_first * 16 == first_keys
print(source_of(blackwell_load_mma, "LoadMmaRoles.gemm_pv"))

# %% [markdown]
# The softmax side is two loops in `softmax_step` (`stage3_fwd_kernel/blackwell_softmax.py`): the
# first exponentiates each quarter (`exp2_row_packed`, the shared policy) and packs it to 16 bits into
# the row's P registers; the second issues the four `tcgen05.st` stores, and after quarter 3 fences and
# arrives on `p_full`. The quarters go in key order because the MMA's K steps read P in key order: the
# first six steps of `P V` need exactly the first 96 keys, so the MMA starts a quarter of the row
# earlier. In the source the stores follow all the exponentials (a store per quarter spilled);
# ptxas's schedule moves each store up next to its quarter. The 2-CTA backward's counterpart, the
# DSMEM exchange of half of dS, is in tutorial 04.
#
# **Status, plainly**: `blackwell_fwd.py` is compiled for `sm_100a` with fake tensors in CI
# (`tests/test_stage3_blackwell.py` checks the SASS for the tcgen05 MMAs, TMEM loads/stores and
# no local memory). No Blackwell GPU is reachable from this project: the kernel has **never run**,
# and nothing in this notebook measures it.
#
# ## Exercise
# Predict the H100 roofline of a `128 x 128` tile at head dim `d = 96` (the kernel supports it):
# the MMA, SMEM and exp cycles, which resource bounds it, and the exp/MMA ratio. Hints: 4096
# FLOP/clk/SM; each 64-row consumer warpgroup reads all of K and V from shared memory, plus its own
# Q slice; 128 bytes of SMEM per clock.
#
# <details><summary>Answer</summary>
#
# MMA: `4 * 128 * 128 * 96 / 4096 = 1536`. exp: `128 * 128 / 16 = 1024` (independent of d).
# SMEM: two warpgroups, each reading Q (64 x 96) + K (128 x 96) + V (128 x 96) elements =
# `2 * (6144 + 12288 + 12288) = 61440` elements, `* 2 bytes / 128 = 960`. Bound: MMA, with
# exp/MMA = 64/96 ≈ 0.67 — the exponentials fill two thirds of the tile time, so the ping-pong
# has less slack than at d = 128.
# </details>

# %%
c96 = forward_tile_cycles(128, 128, 96, H100)
print(c96, c96.bound)
assert (c96.mma, c96.smem, c96.exp, c96.bound) == (1536, 960, 1024, "MMA") and c96.exp / c96.mma == 64 / 96

# %% [markdown]
# **Next**: [04 · the backward kernel](04_backward_kernel.ipynb): five MMAs per tile, shared
# memory as the bound, and the 2-CTA trick that relieves it.
