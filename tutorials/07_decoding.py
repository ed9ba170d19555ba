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
# # 07 · Decoding: split-KV, packed GQA heads, and the merge
#
# **What you will learn**
# - why a decode step (one or a few query tokens against a long KV cache) is bound by memory, not
#   by the tensor cores, and why one CTA per head leaves most of a GPU idle;
# - how a split-KV launch spreads one sequence's cache over the SMs: chunk `j` of sequence `b` is
#   virtual sequence `b n + j`, whose bounds the kernel computes from `(b, j, chunk, cache_seqlens[b])`;
# - why the chunks' partial results merge exactly -- stage 1's log-sum-exp combine, where a chunk
#   that saw no key weighs 0;
# - how the query heads of a GQA group become the rows of one tile, and how a few causal query
#   tokens (speculative decoding) keep their diagonal across chunks;
# - how `fa4` picks the number of splits, and what an H200 measures;
# - what a Hugging Face model's `generate()` calls, step by step: a left-padded cache read in place.
#
# **The idea**: the paper's forward gives each CTA one tile of queries and walks every key block.
# In decode there is one query row per head, so a tile is mostly empty and the work is reading K
# and V once. At small batch, the way to use the whole memory system is to give many CTAs a piece
# of the *keys* of one sequence, then combine their partial softmaxes -- the same rescaling the online
# softmax does between key blocks (notebook 01), done once between chunks.
#
# **Code path**: `stage3_fwd_kernel/components/key_split.py` (the chunk arithmetic),
# `stage3_fwd_kernel/hopper/host.py` (`attention_split_forward`), `stage3_fwd_kernel/split_combine.py`
# (`PartsCombine`, the merge), `fa4/_kvcache.py` (behind `fa4.flash_attn_with_kvcache`: the plan,
# the number of splits, GQA packing), `fa4/README.md` (*Decoding with a KV cache*).
#
# **Status**: the split launch runs and is verified on an H200 (`tests/test_fa4_kvcache_gpu.py`).
# This notebook runs on a CPU: the arithmetic in float64, and the kernel's own trace-time functions
# called on Python integers. The last section reads the committed H200 measurements.

# %%
import json
import math
import pathlib

import matplotlib.pyplot as plt
import numpy as np

import fa4
from fa4 import _dispatch, _kvcache
from fa4._paged import head_rows
from stage0_reference import attention_forward
from stage3_fwd_kernel.components.key_split import KeySplit, chunk_blocks, chunk_of

RESULTS = pathlib.Path(fa4.__file__).resolve().parents[1] / "benchmarks" / "results"
rng = np.random.default_rng(0)

# %% [markdown]
# ## A decode step reads; it hardly computes
# One token of a model with 32 query heads and 8 KV heads (GQA 32 / 8), head dim 128, bf16, against
# a cache of `L` keys: every KV head's K and V are read once (`2 L d` values of 2 bytes), and each of
# its 4 query heads does `L d` multiply-adds for `Q K^T` and as many for `P V` (`4 L d` flops a head).

# %%
hq, hkv, d, L = 32, 8, 128, 16384
bytes_read = 2 * L * hkv * d * 2 + 2 * hq * d * 2          # K and V, plus q and the output
flops = 4 * L * hq * d
print(f"bytes {bytes_read / 1e6:.1f} MB, flops {flops / 1e9:.2f} GFLOP, {flops / bytes_read:.1f} flop/byte")
# an H200: about 989 TFLOP/s dense bf16 and 4.8 TB/s of HBM3e (NVIDIA's H200 datasheet)
ridge = 989e12 / 4.8e12
print(f"the H200's ridge point: {ridge:.0f} flop/byte -> decode sits {ridge / (flops / bytes_read):.0f}x below it")
print(f"at 4.8 TB/s the step takes at least {bytes_read / 4.8e12 * 1e6:.1f} us")

# %% [markdown]
# So the only thing that matters is how fast K and V stream from HBM. The forward kernel of
# notebook 03 gives each CTA one tile of query rows of one head: at batch 1 that is 32 CTAs (8 with
# the group's 4 heads packed into one tile, below), each walking all 16k keys, on a GPU of 132 SMs.
# A few SMs cannot pull more than a fraction of the HBM bandwidth.
#
# ## Split the keys, merge the parts
# Cut the cache into `n` chunks. Chunk `j` computes, for each query row, its output `O_j`
# normalised by its own row sum and its log-sum-exp `lse_j`. Then
#
# `lse = log sum_j exp(lse_j)`,  `O = sum_j exp(lse_j - lse) O_j`
#
# which is exactly the softmax over all keys: `exp(lse_j - lse)` is the share of the row's total
# weight that chunk `j` holds. A chunk with no key in use has `lse_j = -inf` and weighs 0. Below, in
# float64 with the stage 0 oracle, one token of 4 query heads against 1000 keys, chunks of 256:

# %%
def chunk_parts(q, k, v, used, chunk):
    """Per chunk: (O_j (1, 1, H, D), lse_j (1, H, 1)) from the stage 0 oracle; an empty chunk gives 0, -inf."""
    parts = []
    for first in range(0, k.shape[1], chunk):
        n_keys = max(0, min(used - first, chunk))
        if n_keys == 0:
            parts.append((np.zeros_like(q), np.full((1, q.shape[2], 1), -np.inf)))
        else:
            parts.append(attention_forward(q, k[:, first:first + n_keys], v[:, first:first + n_keys]))
    return parts


def merge(parts):
    lse_j = np.stack([lse for _, lse in parts])                         # (n, 1, H, 1)
    top = lse_j.max(0)
    top = np.where(np.isfinite(top), top, 0.0)
    weight = np.exp(lse_j - top)                                        # 0 where a chunk saw nothing
    total = weight.sum(0)
    lse = top + np.log(total)
    share = weight / total                                              # exp(lse_j - lse)
    out = sum(s.transpose(0, 2, 1)[..., None] * o for s, o in zip(share, (o for o, _ in parts)))
    return out, lse


q = rng.standard_normal((1, 1, 4, 64))
k = rng.standard_normal((1, 1280, 4, 64))           # a cache of 1280 slots ...
v = rng.standard_normal((1, 1280, 4, 64))
used = 1000                                         # ... of which 1000 are in use: the 5th chunk is empty
parts = chunk_parts(q, k, v, used, chunk=256)
out, lse = merge(parts)
want_out, want_lse = attention_forward(q, k[:, :used], v[:, :used])
print("chunks:", len(parts), "| lse of each chunk, head 0:", np.round([p[1][0, 0, 0] for p in parts], 3))
print("max |merged - unsplit|: out", np.abs(out - want_out).max(), " lse", np.abs(lse - want_lse).max())
assert np.allclose(out, want_out, atol=1e-13) and np.allclose(lse, want_lse, atol=1e-13)

# %% [markdown]
# The GPU merge (`split_combine.PartsCombine`, one warp per output row) is this formula: each lane
# takes the parts' lse values, one per lane, and two warp reductions give the maximum and the sum;
# then the lanes accumulate `dv / 32` columns each. It is launched as a *programmatic dependent*:
# its CTAs may become resident on the SMs the split launch leaves free (4 of 132 at batch 1) and
# wait there in `griddepcontrol.wait`, so the merge does not pay a launch after the attention kernel
# ends. The split launch is one too: its CTAs start while the previous step's merge runs, and wait
# before they read anything.
#
# ## The kernel's chunk arithmetic, on Python integers
# The split launch needs no index tensors. Its batch mode counts `B n` virtual sequences; virtual
# sequence `v = b n + j` finds its keys from `v`, `n`, the chunk size and `cache_seqlens[b]`.
# `chunk_of` is the device function itself (CuTe-DSL functions run on plain integers at trace
# time): two sequences using 1000 and 300 keys of a 1024-key cache, 4 chunks of 256 keys each.

# %%
split = KeySplit(num_splits=4, chunk_keys=256, paged=False)
print(" v | sequence | first key | keys to the end | key blocks walked (of 128 keys)")
for virtual in range(8):
    c = chunk_of(split, virtual, 1024, [1000, 300])
    walked = min(chunk_blocks(split, 128), math.ceil(int(c.keys_to_end) / 128))
    print(f"{virtual:2d} | {int(c.sequence):8d} | {int(c.first_key):9d} | {int(c.keys_to_end):15d} | {walked}")

# %% [markdown]
# A chunk past a sequence's end (`keys to the end` = 0) walks no block and leaves lse = -inf. A chunk
# sees its keys *to the sequence's end*, not to the chunk's end: its walk stops at the chunk's last
# block, but the mask measures its diagonal from the end of the whole sequence. That is what lets a
# causal call split: the causal diagonal (bottom-right aligned) falls where it does in the unsplit
# sequence, so every chunk left of it is unmasked.
#
# A sliding window of left edge `w` shows one decoding token only the last `W = w + 1` keys of its
# sequence. That is a *key range*, not a mask: with `range_keys = W` the chunks start at key
# `max(L - W, 0)` (any key, not only a multiple of 128: a dense cache is read by TMA at any row), the
# walk reads W keys instead of L, and no block is masked. The same two sequences with a 300-key window,
# 2 chunks of 256 keys:

# %%
ranged = KeySplit(num_splits=2, chunk_keys=256, paged=False, range_keys=300)
for virtual in range(4):
    c = chunk_of(ranged, virtual, 1024, [1000, 300])
    first, used = int(c.first_key), min(256, int(c.keys_to_end))
    keys = f"keys {first} .. {first + used - 1}" if used else "empty"
    print(f"v {virtual}: sequence {int(c.sequence)}, {keys}")

# %% [markdown]
# A server that keeps each request in a fixed slot of one big cache passes `cache_batch_idx`: sequence
# `b` lives in cache row `cache_batch_idx[b]`. The chunk arithmetic does not change; only the row of K
# and V that the CTAs read does (`cache_rows`, one integer load per CTA). The queries, the keys in use
# and the parts stay indexed by `b`. The same two sequences in slots 5 and 2:

# %%
slotted = KeySplit(num_splits=2, chunk_keys=512, paged=False, cache_rows=[5, 2])
for virtual in range(4):
    c = chunk_of(slotted, virtual, 1024, [1000, 300])
    print(f"v {virtual}: sequence {int(c.sequence)}, cache row {int(c.batch_kv)}, first key {int(c.first_key)}, "
          f"{int(c.keys_to_end)} keys to the end")

# %% [markdown]
# A batch padded on the left (prompts of different lengths, their padding first, as generation pads
# them) stores sequence `b`'s keys from row `p_b` of its cache row. `key_starts` (FlashAttention-2's
# `cache_leftpad`) moves the chunks' origin there: the chunks cover keys `[p_b, L)` and the padding is
# never read. The masks need nothing new: they count from the sequence's end, which did not move. The
# same two sequences with 100 and 300 keys of padding (the second is all padding):

# %%
padded = KeySplit(num_splits=2, chunk_keys=512, paged=False, key_starts=[100, 300])
for virtual in range(4):
    c = chunk_of(padded, virtual, 1024, [1000, 300])
    print(f"v {virtual}: sequence {int(c.sequence)}, first key {int(c.first_key)}, "
          f"{int(c.keys_to_end)} keys to the end")

# %% [markdown]
# Several tokens (or pages, whose blocks the kernel finds one at a time, so a paged range starts on
# the key block below `L - W`) keep the window's mask. That needs nothing new from the walk: the
# window's edges, like the causal diagonal, are measured from the sequence's end (`keys to the end`),
# so each chunk's first block is the one holding its rows' left edge, and a chunk wholly left of the
# window walks nothing. Without a range, 2 tokens with a 300-key window over a 1000-key sequence,
# 4 chunks of 256 keys, through the kernel's own `key_range`:

# %%
import cutlass  # noqa: E402  (CuTe-DSL: the kernel object is built on the CPU, nothing is compiled)

from stage3_fwd_kernel.components.window import Window  # noqa: E402
from stage3_fwd_kernel.components.work_tile import SequenceInfo  # noqa: E402
from stage3_fwd_kernel.hopper import FlashAttentionForwardSm90  # noqa: E402

windowed = FlashAttentionForwardSm90(cutlass.BFloat16, head_dim=64, head_dim_v=64, causal=True, tile_m=64,
                                     key_split=True, window=Window(300, None))
windowed.varlen, windowed.q_shift = False, False
windowed.split = KeySplit(num_splits=4, chunk_keys=256, paged=False)
seq = SequenceInfo(2, 1024, 1, None, None, [1000], None, windowed.split)
for virtual in range(4):   # the tokens see keys 698 .. 998 and 699 .. 999
    lo, hi = (int(x) for x in windowed.key_range(windowed.locate(0, 0, virtual, seq)))
    first = 256 * virtual
    walked = f"reads keys {first + 128 * lo} .. {first + 128 * hi - 1}" if hi > lo else "walks nothing"
    print(f"chunk {virtual} (keys {first} .. {first + 255}): {walked}")

# %% [markdown]
# ## GQA heads as rows, and causal tokens masked by token
# The 4 query heads of a KV head read the same K and V. Packed as 4 rows of one tile, they share one
# walk over the cache: a quarter of the traffic of one tile per query head. With `T` causal query
# tokens (a speculative-decoding step) row `t g + j` is token `t` of head `j`, and the mask takes the
# row's *token*: `AttentionMask.query_of(row) = row // g`. The kernel's mask, on Python integers:
# 4 tokens x 4 heads = 16 rows, a sequence of 700 keys, the chunk that holds its last keys.

# %%
g, tokens, seq_len = 4, 4, 700
# head dims 64 / 64 (any would do: only the mask is used), causal, 64-row tiles, 128-key blocks
kernel = FlashAttentionForwardSm90(cutlass.BFloat16, head_dim=64, head_dim_v=64, causal=True, tile_m=64,
                                   key_split=True, rows_per_query=g)
mask, tile_n = kernel.mask, kernel.tile_n
last = KeySplit(num_splits=3, chunk_keys=256, paged=False)
c = chunk_of(last, 2, 768, [seq_len])                          # chunk 2: keys 512 .. 699
keys_to_end, block = int(c.keys_to_end), 1                     # its 2nd key block: keys 640 .. 767
limits = [int(mask.key_limit(mask.query_of(row), block, tokens, keys_to_end)) for row in range(tokens * g)]
cols = np.arange(40, 64)                                       # keys 680 .. 703 of the sequence
visible = np.array([[col < lim for col in cols] for lim in limits])
print("row -> last visible key:", {row: int(c.first_key) + block * tile_n + lim - 1 for row, lim in enumerate(limits)})

fig, ax = plt.subplots(figsize=(7, 3.2))
ax.imshow(visible, cmap="Greens", aspect="auto")
ax.set_xticks(range(0, len(cols), 4), [int(c.first_key) + block * tile_n + x for x in cols[::4]])
ax.set_yticks(range(tokens * g), [f"t{r // g} h{r % g}" for r in range(tokens * g)])
ax.set_xlabel("key (the sequence has 700: keys 700+ are unused cache slots)")
ax.set_title("the kernel's mask for 4 causal tokens x 4 packed heads, chunk 2 of 3")
plt.tight_layout()
plt.show()
assert limits[::g] == [limits[g * t + 3] for t in range(tokens)]      # the 4 heads of a token agree
assert int(c.first_key) + block * tile_n + limits[-1] == seq_len       # the last token sees every key

# %% [markdown]
# Token 0 sees keys up to 696, token 3 up to 699: the diagonal of a 4-token step at the sequence's
# end, in the one chunk that holds it. Chunks 0 and 1 are wholly left of it: no key there is masked.
# `fa4` packs a causal group while its rows fit one 64-row tile (`PACKED_CAUSAL_ROWS`), so a step
# of up to 16 tokens of GQA 32 / 8 is one walk per KV head.
#
# ## How many splits
# `fa4` fills the SMs once: `sm_count // CTAs` splits, at most one per 256 keys and 64 in all, and
# chunks of a multiple of the 128-key block, so each starts on a block (`choose_num_splits`,
# `split_chunks`; a sequence's last chunk may be shorter). Two waves were slower on an
# H200 than one (`docs/measurements.md`, 2026-11-29): a CTA of the split launch takes most of an
# SM's shared memory, so a second wave runs after the first instead of beside it.

# %%
sms = 132
print("batch x cache | CTAs unsplit | splits | keys a chunk | CTAs")
for b, cache in [(1, 8192), (1, 16384), (1, 131072), (8, 32768), (64, 8192)]:
    head_tiles = hkv                                          # one 64-row tile per KV head (4 heads packed)
    n = _kvcache.choose_num_splits(b, head_tiles, cache, sms)
    chunk, n = _kvcache.split_chunks(cache, n)
    print(f"{b:5d} x {cache // 1024:3d}k | {b * head_tiles:12d} | {n:6d} | {chunk:12d} | {b * head_tiles * n}")

# %% [markdown]
# ## What an H200 measures
# `python -m benchmarks.bench_decode` (GQA 32 / 8, d = 128, one token, each call in a CUDA graph):
# achieved GB/s of Q, K and V read, against the official FlashAttention-4 (no split-KV on Hopper),
# cuDNN through SDPA and a copy kernel over K in the same run. The copy is a yardstick, not a ceiling:
# it reads and writes, and its rate depends on the size (3.9-4.3 TB/s from 1 x 16k on). At 1 x 8k K and
# its copy fit the L2 between the graph's calls, so that bar is not a DRAM rate.

# %%
path = RESULTS / "bench_decode_h200.json"
if path.exists():
    doc = json.loads(path.read_text())
    peers = ["fa4_kvcache", "official", "sdpa_cudnn", "copy_k"]
    labels = [f"{r['batch']}x{r['cache'] // 1024}k" for r in doc["results"]]
    gbs = {p: [r["peers"][p]["gb_per_s"] for r in doc["results"]] for p in peers}
    x = np.arange(len(labels))
    fig, ax = plt.subplots(figsize=(9, 3.5))
    for i, p in enumerate(peers):
        ax.bar(x + (i - 1.5) * 0.2, gbs[p], 0.2, label=p)
    ax.set_xticks(x, labels)
    ax.set_ylabel("GB/s")
    ax.set_title(f"decode on an {doc['device']} (commit {doc['git_commit']})")
    ax.legend(ncol=4, fontsize=8)
    plt.tight_layout()
    plt.show()
    for label, ours, copy in zip(labels, gbs["fa4_kvcache"], gbs["copy_k"]):
        print(f"{label:>7}: fa4 {ours:5.0f} GB/s = {ours / copy:4.0%} of the copy")
else:
    print("no committed measurement at", path)

# %% [markdown]
# At batch 1 and 16k keys a step is about 22 us: each CTA starts 3.6 us after its entry (its wait
# for the previous step's merge, then Q), its keys stream for 13-17 us (median 16), and the rest is
# the merge, the grid boundaries and the spread of the CTAs' ends (the log's timeline, 2026-11-30).
# The longer the cache, the smaller that fixed share: 1 x 128k reaches the copy.
#
# ## Exercise
# (1) A 1 x 16k step of GQA 32 / 8 runs 16 splits. How many CTAs is that, how many keys does each
# walk, and how many bytes of K and V does each read (d = 128, bf16)? (2) Why is 32 splits slower
# than 16 on 132 SMs, when it has twice the CTAs? (3) A chunk's `O_j` is stored in bf16, normalised by its
# own row sum. Why normalise it, rather than store the unnormalised sum?
#
# <details><summary>Answer</summary>
#
# (1) 8 KV heads x 16 = 128 CTAs, 16384 / 16 = 1024 keys each (8 blocks of 128), 1024 x 128 x 2
# bytes x 2 (K and V) = 512 KiB each. (2) A CTA takes most of an SM's shared memory (Q and three
# K/V stages), so 32 x 8 = 256 CTAs run as two waves: each CTA walks half the keys, but each SM pays
# a CTA's fixed start and end twice in a row, and the first wave's last CTAs delay the second (on an
# H200: 26.7 us a step against 22.3, the log's timeline of 2026-11-30). (3) Normalised, (`O_j`,
# `lse_j`) is the chunk's whole result and the merge needs only `exp(lse_j - lse)`; an unnormalised
# sum is relative to the chunk's own running maximum, which the merge would need too. It is also the
# kernel's usual epilogue (an unsplit call writes its result the same way), and `O_j` stays within
# the range of V, which matters in fp16 (largest value 65504); bf16 has fp32's range.
# </details>

# %%
ctas, keys = hkv * 16, 16384 // 16
assert (ctas, keys, keys * d * 2 * 2) == (128, 1024, 512 * 1024)
assert math.ceil(hkv * 32 / sms) == 2 and _kvcache.split_chunks(16384, 32) == (512, 32)  # two waves
print("CTAs", ctas, "| keys a CTA", keys, "| KiB of K and V a CTA", keys * d * 2 * 2 // 1024)

# %% [markdown]
# ## Paged caches, next to FlashInfer
# `python -m benchmarks.bench_paged --only decode --page-sizes 16,64` times the same steps over shuffled
# pages of 16 and 64 keys, beside FlashInfer's paged decode (its CUDA-core kernel `flashinfer_cc` and its
# tensor-core kernel `flashinfer_tc`) and the official paged path. Where one sequence cannot fill the
# SMs (1 x 16k), the split launch is what puts fa4 ahead; from 1 x 128k on, fa4 and FlashInfer's
# tensor-core kernel both read at the bandwidth limit, and the ratio is within about a percent of 1.

# %%
path = RESULTS / "bench_paged_decode_flashinfer_r2_h200.json"
if path.exists():
    doc = json.loads(path.read_text())
    rows = doc["results"]
    peers = ["fa4_paged", "flashinfer_tc", "flashinfer_cc", "official_paged", "copy_k"]
    labels = [f"{r['batch']}x{r['cache'] // 1024}k p{r['page_size']}" for r in rows]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(10, 3.5))
    for i, p in enumerate(peers):
        ax.bar(x + (i - 2) * 0.16, [r["peers"][p]["gb_per_s"] for r in rows], 0.16, label=p)
    ax.set_xticks(x, labels, fontsize=8)
    ax.set_ylabel("GB/s")
    ax.set_title(f"paged decode on an {doc['device']}")
    ax.legend(ncol=5, fontsize=8)
    plt.tight_layout()
    plt.show()
    for label, r in zip(labels, rows):
        print(f"{label:>12}: fa4 / FlashInfer {r['fa4_vs_flashinfer']:.3f}, fa4 paged / dense {r['paged_vs_dense']:.2f}")
else:
    print("no committed measurement at", path)

# %% [markdown]
# ## Prefill over pages: read in place, or copy first?
# A decode step waits on memory, so reading 16-key pages in place costs it little. A prefill, or a
# chunk of a long prompt appended to a cache (chunked prefill), is compute-bound, and there pages of
# 16 cost the kernel 5-10%: each 128-key block is 16 TMA copies of 2 KB instead of 2. The other route
# is to gather the pages into a dense K and V first (`stage3_fwd_kernel/page_gather.py`, about
# 70 us for 32k tokens of 8 KV heads at d = 128 on an H200) and run the dense kernel.
#
# The copy costs per key and KV head. The in-place penalty is a share of the attention, which per key
# is the number of query-head rows that attend it: the group times the (query, key) pairs the mask
# lets through, divided by the keys (`fa4._paged.head_rows`). fa4 copies once that reaches
# `SMALL_PAGE_COPY_HEAD_ROWS`. A square causal prefill attends half its pairs; a chunk at the end
# of a long cache attends nearly all of them, so the same 2048 queries copy as a chunk and stay in
# place as a square prefill. In the plot below (an H200, `docs/measurements.md`, 2026-12-03), the two
# routes cross between about 4100 and 7700 head rows; the lowest points, a chunk of 512 queries, are
# short calls where the host's work per call (the copy's launch and checks) shows.

# %%
threshold = _dispatch.SMALL_PAGE_COPY_HEAD_ROWS
for tokens, keys in ((2048, 2048), (2048, 16384), (4096, 4096), (512, 16384)):
    rows = head_rows(tokens, keys, group=4, causal=True)
    print(f"{tokens:5d} queries over {keys:5d} keys, GQA 4: {rows:7.0f} head rows a key -> "
          f"{'copy' if rows >= threshold else 'in place'}")
assert head_rows(2048, 16384, 4, True) >= threshold > head_rows(2048, 2048, 4, True)

path = RESULTS / "probe_paged_copy_threshold_h200.json"
if path.exists():
    pts = [r for r in json.loads(path.read_text())["results"] if r["page_size"] == 16]
    xs = [head_rows(r["sq"], r["sk"], 4, True) for r in pts]
    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    ax.scatter(xs, [r["in_place_vs_dense"] for r in pts], label="in place")
    ax.scatter(xs, [r["copy_vs_dense"] for r in pts], marker="s", label="through the copy")
    ax.axvline(threshold, color="gray", ls="--", lw=1)
    ax.set_xscale("log")
    ax.set_xlabel("query-head rows attending a key (GQA 4)")
    ax.set_ylabel("dense time / time")
    ax.set_title("pages of 16, causal, H200")
    ax.legend(fontsize=8)
    plt.tight_layout()
    plt.show()
else:
    print("no committed measurement at", path)

# %% [markdown]
# ## A model's generate(), call by call
# Through transformers (`register_fa4_attention()`, then `attn_implementation="fa4"`), a batch of
# prompts of different lengths arrives left-padded: row b's first `pad_b` columns hold no token. A
# prefill of more than 64 tokens (the whole prompt at once) runs `flash_attn_varlen_func` on a layout of
# fixed shape: every row's queries (padding queries see no key) against the row's valid keys. Each later
# step has one query token a row, and the KV cache transformers holds is the padded `(batch, columns,
# Hkv, d)` buffer. Gathering each row's valid keys into a packed copy every step would read and write
# the whole cache once more than the attention reads it; instead the step calls
# `flash_attn_with_kvcache` on the buffer as it is, with `cache_leftpad[b] = pad_b` and
# `cache_seqlens[b] =` the columns so far: row b's split chunks start at its first valid key.
# (`fa4_mask`, the mask function the registration installs, reads once per forward whether each row's
# padding is all at its start, and hands the layers a `LeftPadding`: the mask with the two vectors.)
#
# Below, a tiny random Llama (head dim 64, one the Hopper kernels have) generates on the CPU. The two
# fa4 functions the integration calls here are replaced by float64 references that record their
# arguments, and the integration is told the split launch takes the step, as it does on an H100 or
# H200. fa4's tokens must equal transformers' eager attention.
# The last column says whether launch plans were on: transformers' DynamicCache grows by a key a step,
# so every step is a new signature and a plan would be recorded for it and replayed by that step's
# later layers only; the integration runs such steps without plans (`fa4/README.md`, the
# *Hugging Face transformers* section, has the measurements).

# %%
try:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig
except ImportError:  # the tutorials install has it; a bare fa4 install does not
    torch = None
    print("transformers is not installed: `pip install transformers` to run this section")

if torch is not None:
    from fa4 import _plans
    from fa4.integrations import transformers as integ
    from stage0_reference.torch_reference import attention_ref, attention_varlen_ref

    calls = []

    def varlen_on_cpu(q, k, v, *, cu_seqlens_q, cu_seqlens_k, softmax_scale=None, causal=False, **rest):
        calls.append(("varlen", q.shape[0], None, None, _plans.enabled()))   # q.shape[0]: packed query rows
        out = attention_varlen_ref(q.double(), k.double(), v.double(), cu_seqlens_q, cu_seqlens_k,
                                   softmax_scale=softmax_scale, causal=causal)[0]
        return out.to(q.dtype)                                                  # (total_q, Hq, Dv)

    def kvcache_on_cpu(q, k_cache, v_cache, *, cache_seqlens, cache_leftpad, softmax_scale=None,
                       causal=False, **rest):
        """Row b attends to cache rows [cache_leftpad[b], cache_seqlens[b]) of the buffer, read in place."""
        first, lens = cache_leftpad.tolist(), cache_seqlens.tolist()
        calls.append(("kvcache", k_cache.shape[1], first, lens, _plans.enabled()))
        rows = [attention_ref(q[b:b + 1].double(), k_cache[b:b + 1, f:n].double(),
                              v_cache[b:b + 1, f:n].double(), softmax_scale=softmax_scale, causal=causal)[0]
                for b, (f, n) in enumerate(zip(first, lens))]
        return torch.cat(rows).to(q.dtype)                                      # (B, Sq, Hq, Dv)

    saved = (integ.flash_attn_varlen_func, integ.flash_attn_with_kvcache, integ._split_launch_takes)
    integ.flash_attn_varlen_func, integ.flash_attn_with_kvcache = varlen_on_cpu, kvcache_on_cpu
    integ._split_launch_takes = lambda q, k, v, sink, tokens, keys: tokens <= 64  # sm_90, head dim 64
    try:
        integ.register_fa4_attention()
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=97, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=64)
        model = AutoModelForCausalLM.from_config(config).eval()
        ids = torch.randint(1, 97, (3, 70), generator=torch.Generator().manual_seed(1))
        mask = torch.ones_like(ids)
        for row, pad in enumerate((0, 2, 5)):   # left padding: row b's first pad_b columns are empty
            mask[row, :pad] = 0
        tokens = {}
        for impl in ("fa4", "eager"):
            model.set_attn_implementation(impl)
            with torch.no_grad():
                tokens[impl] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4,
                                              do_sample=False, pad_token_id=0, output_logits=True,
                                              return_dict_in_generate=True)
    finally:
        integ.flash_attn_varlen_func, integ.flash_attn_with_kvcache, integ._split_launch_takes = saved

    assert torch.equal(tokens["fa4"].sequences, tokens["eager"].sequences), "fa4's tokens differ from eager's"
    gap = max((a - b).abs().max().item() for a, b in zip(tokens["fa4"].logits, tokens["eager"].logits))
    assert gap < 1e-4, f"fa4's scores differ from eager attention's by {gap:.2e}"
    print("generated tokens equal eager attention's:", tokens["fa4"].sequences[:, 70:].tolist(),
          f"| largest score difference {gap:.1e}")
    print(f"{'layer call':>10} {'function':>8} {'cache columns':>13}  {'cache_leftpad':>13}  "
          f"{'cache_seqlens':>13}  plans")
    for i, (kind, rows, first, lens, plans_on) in enumerate(calls):
        where = f"{rows:13d}" if kind == "kvcache" else f"{'(' + str(rows) + ' packed)':>13}"
        print(f"{i:10d} {kind:>8} {where}  {str(first):>13}  {str(lens):>13}  {'on' if plans_on else 'off'}")
    steps = [c for c in calls if c[0] == "kvcache"]
    assert calls[0][0] == "varlen" and len(steps) == 3 * config.num_hidden_layers  # a prefill, then 3 steps
    assert [c[3] for c in steps[::2]] == [[71] * 3, [72] * 3, [73] * 3] and not any(c[4] for c in steps)
    assert all(c[2] == [0, 2, 5] for c in steps)  # each row's keys start past its padding

# %% [markdown]
# Row 2's five padding columns are never read: its chunks start at column 5. Every step reads one more
# column (`cache_seqlens` 71, 72, 73: the buffer grows with the cache), and no step runs with plans. (A
# prompt of at most 64 tokens takes the in-place call for its prefill too.) What
# those plans would cost, by the number of layers (an H100, `python -m benchmarks.bench_hf_generate
# --layers L --rounds 5 --fresh-lengths --peers fa4,fa4_plans`, each round on cache lengths no plan had
# seen). At 32 layers the rounds without plans slowed during the run (cause not found), and the two
# rounds before that had plans slower; no depth gained in every round.

# %%
depths = []
for layers in (4, 8, 16, 32):
    path = RESULTS / f"bench_hf_generate_plans_depth_l{layers}_h100.json"
    if path.exists():
        rows = {r["peer"]: r for r in json.loads(path.read_text())["results"]}
        ratios = [p / f for p, f in zip(rows["fa4_plans"]["rounds_ms"], rows["fa4"]["rounds_ms"])]
        depths.append((layers, rows["fa4_plans"]["over_fa4"], min(ratios), max(ratios)))
if depths:
    fig, ax = plt.subplots(figsize=(5.5, 3))
    x = np.arange(len(depths))
    med = np.array([d[1] for d in depths])
    err = np.array([[d[1] - d[2] for d in depths], [d[3] - d[1] for d in depths]])
    ax.bar(x, med, yerr=err, capsize=4)
    ax.axhline(1.0, color="gray", ls="--", lw=1)
    ax.set_xticks(x, [f"{d[0]} layers" for d in depths])
    ax.set_ylabel("time with plans / without")
    ax.set_title("growing cache, unseen lengths (median, range of 5 rounds)", fontsize=9)
    plt.tight_layout()
    plt.show()
    for layers, m, lo, hi in depths:
        print(f"{layers:2d} layers: plans / no plans {m:.2f} (rounds {lo:.2f}-{hi:.2f})")
else:
    print("no committed measurement under", RESULTS)

# %% [markdown]
# **Next**: `fa4/README.md`, *Decoding with a KV cache*, for `flash_attn_with_kvcache` (paged caches,
# appends with rotary embedding, the splits heuristic) and its measured tables; [08 · context
# parallelism](08_context_parallel.ipynb), the same merge between GPUs; or back to
# [06 · using fa4](06_using_fa4.ipynb).
