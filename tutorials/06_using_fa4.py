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
# # 06 · Using `fa4`: the kernels behind one call
#
# **What you will learn**
# - how a model calls the kernels of stages 3-5 through a FlashAttention-compatible API
#   (`fa4.flash_attn_func`, `fa4.flash_attn_varlen_func`) or as a drop-in for torch's SDPA;
# - what `fa4` checks before it launches anything, and what its errors say;
# - how to pack a variable-length batch (`cu_seqlens`);
# - why `fa4` is a set of `torch.library` custom ops (so `torch.compile(fullgraph=True)` traces
#   through it), and how its compile cache keeps CuTe-DSL's compile time out of every new process.
#
# **The idea, in the paper's words** (§4, *Language and Framework*): "By embedding CuTe-DSL in
# Python with just-in-time (JIT) compilation, FlashAttention-4 achieves faster build times compared
# to traditional C++ template-based approaches ... Operations such as block-sparse patterns,
# masking strategies, variable sequence length handling, and work scheduling are all exposed as
# orthogonal primitives that can be freely combined." A package around JIT-compiled kernels still
# has to hide the compile (cache it), check inputs before a launch, and speak the framework's
# language (autograd, `torch.compile`).
#
# **Code path**: `fa4/_api.py` (the three functions), `_validate.py` (the checks), `_dispatch.py`
# (device capability -> kernel module, `supported()`), `_ops.py` (custom ops + autograd),
# `_cache.py` (the on-disk compile cache), `fa4/README.md`.
#
# **Status**: on an H100 (`sm_90`) `fa4` runs the stage-3 forward and the stage-4 backward, both
# verified there (notebooks 03 and 04). On this CPU-only machine the notebook uses meta / fake
# tensors, which trace shapes through `fa4` without a GPU, and compiles a kernel for `sm_90a`; the
# last cell runs a small model on a GPU when one is present (untested on this machine).

# %%
import os
import pathlib
import shutil
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F

import fa4

print("fa4", fa4.__version__, "| torch", torch.__version__, "| CUDA available:", torch.cuda.is_available())

# %% [markdown]
# ## What runs where: `fa4.supported()`
# One dictionary, generated from the same tables dispatch and validation read (so the README's
# support matrix cannot claim more than the code does). Importing `fa4` is cheap: no kernel and no
# `cutlass` is imported until an attention function runs on a GPU.

# %%
info = fa4.supported()
for arch, a in info["archs"].items():
    dims = ", ".join(f"{d}" if d == dv else f"{d}/{dv}" for d, dv in a["head_dims"])
    print(f"{arch} ({a['gpus']}): hardware {a['hardware']}; head dims {dims}")
    print(f"    forward {a['forward']}, backward {a['backward'] or 'not landed (raises NotImplementedError)'}")
print("dtypes:", ", ".join(info["dtypes"]))
print("features:", ", ".join(f"{k}{'' if v['supported'] else ' (no)'}" for k, v in info["features"].items()))
print("refused:", info["devices_refused"])

# %% [markdown]
# ## The API
# ```python
# out = fa4.flash_attn_func(q, k, v, softmax_scale=None, causal=False, deterministic=False, return_lse=False)
# out = fa4.flash_attn_varlen_func(q, k, v, cu_seqlens_q=..., cu_seqlens_k=..., max_seqlen_q=..., max_seqlen_k=...)
# out = fa4.scaled_dot_product_attention(query, key, value, is_causal=False, scale=None, enable_gqa=False)
# ```
# The keywords are those of the official FlashAttention-4 (`flash_attn.cute.interface`), and
# everything after `q, k, v` is keyword-only: FlashAttention-2 code such as
# `flash_attn_func(q, k, v, 0.0, causal=True)` (its 4th positional argument is `dropout_p`) gets a
# `TypeError` saying so. fa4 returns `out`, or `(out, lse)` with `return_lse=True`; code written
# for the official package, which always returns `(out, lse)`, imports
# `from fa4.compat import flash_attn_func` instead.
# Tensors are `(batch, seqlen, heads, head_dim)` (SDPA's helper takes `(batch, heads, seqlen,
# head_dim)`), fp16 or bf16, GQA when `heads_q % heads_kv == 0`. On `device="meta"` tensors the
# functions run their *fake* implementations: validation, shapes and dtypes, no kernel. That is
# how we can call them here.

# %%
def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, device="meta", dtype=dtype)


q, k, v = meta(2, 1024, 16, 128), meta(2, 1024, 4, 128), meta(2, 1024, 4, 128)  # GQA 16 / 4
out = fa4.flash_attn_func(q, k, v, causal=True)
out2, lse = fa4.flash_attn_func(q, k, v, causal=True, return_lse=True)
print("flash_attn_func     :", tuple(out.shape), out.dtype, "| lse", tuple(lse.shape), lse.dtype)
from fa4.compat import flash_attn_func as official_style  # the official return convention

out3, lse3 = official_style(q, k, v, causal=True)  # always a tuple; lse None: not asked for, no grad needed
print("fa4.compat          :", tuple(out3.shape), "| lse", lse3)
sdpa_out = fa4.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                            enable_gqa=True)
print("scaled_dot_product_attention (B, H, S, D):", tuple(sdpa_out.shape))

# %% [markdown]
# **Two causal conventions.** `flash_attn_func` aligns the causal mask to the *bottom-right*
# corner when `Sq != Sk` (FlashAttention's convention: the last query is the last token, as
# decoding with a KV cache needs). torch SDPA's `is_causal` is *top-left*. The SDPA helper keeps
# SDPA's meaning so that swapping it in never changes a model; for `Sq < Sk` it runs bottom-right
# causal attention on the first `Sq` keys, which is the same thing. The check below uses the
# stage-0 oracle (bottom-right) against torch SDPA (top-left) on CPU, in float64:

# %%
from stage0_reference import attention_forward, visible_mask

rng = np.random.default_rng(0)
sq, sk = 3, 6
qn, kn, vn = (rng.standard_normal((1, s, 2, 16)) for s in (sq, sk, sk))
print("bottom-right (flash_attn_func), query x key:\n", visible_mask(sq, sk, causal=True).astype(int))
top_left = F.scaled_dot_product_attention(*(torch.from_numpy(x).transpose(1, 2) for x in (qn, kn, vn)),
                                          is_causal=True).transpose(1, 2).numpy()
decomposed, _ = attention_forward(qn, kn[:, :sq], vn[:, :sq], causal=True)  # what the SDPA helper runs
print("top-left SDPA == bottom-right causal on the first Sq keys:", np.allclose(top_left, decomposed, atol=1e-12))
assert np.allclose(top_left, decomposed, atol=1e-12)

# %% [markdown]
# ## Validation: errors that name the argument
# Every check runs before any launch and raises `TypeError` (wrong kind of thing) or `ValueError`
# (wrong value), and the message starts with the argument at fault — in a 30-layer model, that
# says which tensor of which call is wrong. The messages below are produced live.

# %%
i32 = dict(dtype=torch.int32, device="meta")
cu3 = torch.zeros(3, **i32)
packed = dict(q=meta(100, 8, 128), k=meta(100, 2, 128), v=meta(100, 2, 128), max_seqlen_q=64, max_seqlen_k=64)
cases = {
    "fp32 inputs": lambda: fa4.flash_attn_func(meta(2, 64, 8, 128, dtype=torch.float32), k, v),
    "head dim 84": lambda: fa4.flash_attn_func(meta(2, 64, 8, 84), meta(2, 64, 2, 84), meta(2, 64, 2, 84)),
    "3 kv heads for 16 q heads": lambda: fa4.flash_attn_func(q, meta(2, 1024, 3, 128), meta(2, 1024, 3, 128)),
    "CPU tensors": lambda: fa4.flash_attn_func(*(torch.zeros(1, 8, 2, 64, dtype=torch.bfloat16),) * 3),
    "causal=1": lambda: fa4.flash_attn_func(q, k, v, causal=1),
    "cu_seqlens int64": lambda: fa4.flash_attn_varlen_func(**packed, cu_seqlens_q=torch.zeros(3, dtype=torch.int64,
                                                                                              device="meta"),
                                                           cu_seqlens_k=cu3),
    "cu_seqlens_k too short": lambda: fa4.flash_attn_varlen_func(**packed, cu_seqlens_q=cu3,
                                                                 cu_seqlens_k=torch.zeros(2, **i32)),
    "SDPA attn_mask": lambda: fa4.scaled_dot_product_attention(q, q, q, attn_mask=meta(1024, 1024)),
}
for what, call in cases.items():
    try:
        call()
        raise AssertionError(f"{what}: no error")
    except (TypeError, ValueError) as exc:
        print(f"{what:<26} -> {type(exc).__name__}: {exc}")

# %% [markdown]
# A head dim of 84 is refused because it is not a multiple of 8. Any multiple of 8 up to 256 is
# served: pairs without a kernel of their own run zero-padded on the cheapest native pair (zero
# columns change no score), and out comes back at the caller's head dim:

# %%
print("native pair for (80, 80):", fa4._layouts.native_pair(fa4._dispatch.ARCHS["sm_90"], 80, 80))
print("out:", tuple(fa4.flash_attn_func(meta(2, 64, 8, 80), meta(2, 64, 2, 80), meta(2, 64, 2, 80)).shape))

# %% [markdown]
# The *values* inside `cu_seqlens` are not checked by default: reading them needs a device-to-host
# copy, which synchronises the stream, is illegal during CUDA-graph capture and breaks a
# `torch.compile` graph. `FA4_VALIDATE=1` turns the value checks on while debugging; here they
# are called directly:

# %%
from fa4._validate import check_varlen_values

bad = {
    "not starting at 0": (torch.tensor([1, 5, 9], dtype=torch.int32), 9, 8),
    "decreasing": (torch.tensor([0, 5, 4], dtype=torch.int32), 4, 8),
    "max_seqlen too small": (torch.tensor([0, 5, 9], dtype=torch.int32), 9, 4),
}
for what, (cu, total, max_len) in bad.items():
    try:
        check_varlen_values(cu, cu, total, total, max_len, max_len)
        raise AssertionError(f"{what}: no error")
    except ValueError as exc:
        print(f"{what:<22} -> ValueError: {exc}")

# %% [markdown]
# ## Varlen: packing a batch of sequences
# Sequences of different lengths are concatenated along the token axis, and `cu_seqlens` (int32,
# `batch + 1` entries) holds where each one starts: sequence `b` owns rows
# `cu_seqlens[b]:cu_seqlens[b+1]`. `max_seqlen_*` only has to be an upper bound (it sizes the
# grid; a static bound keeps CUDA graphs valid). No padding is stored and no padded token costs a
# FLOP.

# %%
def pack(seqs):
    """A list of (len_i, H, D) tensors -> packed (sum len_i, H, D), int32 cu_seqlens, max length."""
    lens = torch.tensor([s.shape[0] for s in seqs], dtype=torch.int32)
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lens, 0)
    return torch.cat(seqs), cu, int(lens.max())


lengths = [5, 3, 0, 7]
seqs = [torch.randn(n, 2, 16, dtype=torch.float64) for n in lengths]
packed_q, cu, max_len = pack(seqs)
print("lengths", lengths, "-> cu_seqlens", cu.tolist(), ", max_seqlen", max_len, ", packed", tuple(packed_q.shape))

# the same packing, checked with the stage-0 oracle: varlen == one call per sequence
from stage0_reference import attention_varlen_forward

out_packed, _ = attention_varlen_forward(packed_q.numpy(), packed_q.numpy(), packed_q.numpy(), cu.numpy(), cu.numpy(),
                                         causal=True)
for b, s in enumerate(seqs):
    if len(s):
        one, _ = attention_forward(s[None].numpy(), s[None].numpy(), s[None].numpy(), causal=True)
        assert np.allclose(out_packed[cu[b]:cu[b + 1]], one[0], atol=1e-12)
print("varlen output rows cu[b]:cu[b+1] == sequence b alone, for every b")

# with fa4 (meta tensors here; CUDA tensors on a GPU): q (total, Hq, D), k/v (total, Hkv, D)
tot = int(cu[-1])
out_v = fa4.flash_attn_varlen_func(meta(tot, 8, 128), meta(tot, 2, 128), meta(tot, 2, 128),
                                   cu_seqlens_q=cu.to("meta"), cu_seqlens_k=cu.to("meta"), max_seqlen_q=max_len,
                                   max_seqlen_k=max_len, causal=True)
print("fa4.flash_attn_varlen_func ->", tuple(out_v.shape))

# %% [markdown]
# The same function takes a side *padded* instead, `(B, S, H, D)` with that side's `cu_seqlens=None`;
# `seqused_q` / `seqused_k` use only the first rows / keys of each sequence; and a paged k / v comes
# with `page_table`. fa4 turns each into the packed form its kernels take (`fa4/_layouts.py`). For
# `seqused_q`, every sequence becomes two: its used rows against its keys, and the rest against no
# keys, which the kernels already define (output 0, lse -inf, no gradient):

# %%
cu_q = torch.tensor([0, 5, 8, 8, 15], dtype=torch.int32)
used_q = torch.tensor([2, 3, 0, 7], dtype=torch.int32)
cu_q2, cu_k2, _ = fa4._layouts.split_unused_rows(cu_q, cu_q, used_q)
print("cu_seqlens", cu_q.tolist(), "+ seqused_q", used_q.tolist(), "-> query rows", cu_q2.tolist(),
      ", keys", cu_k2.tolist())
used = torch.tensor([7, 1, 0, 4], dtype=torch.int32, device="meta")
out_pad = fa4.flash_attn_varlen_func(meta(4, 7, 8, 128), meta(4, 900, 2, 128), meta(4, 900, 2, 128),
                                     seqused_q=used, seqused_k=used, causal=True)
pool = meta(64, 16, 2, 128)  # 64 pages of 16 keys
out_paged = fa4.flash_attn_varlen_func(meta(4, 7, 8, 128), pool, pool,
                                       page_table=torch.zeros(4, 8, dtype=torch.int32, device="meta"))
print("padded q and k ->", tuple(out_pad.shape), "; paged k / v ->", tuple(out_paged.shape))

# %% [markdown]
# ### How a paged cache is read in place
# A serving system keeps every sequence's keys in fixed-size *pages* of one pool and a table of
# which pages each sequence owns: key `j` of sequence `b` is row `j % page_size` of page
# `page_table[b, j // page_size]`. On Hopper the forward kernel reads the pool through the table
# itself, with no copy (`stage3_fwd_kernel/components/paged_kv.py`). Which reader it uses depends on
# how a page sits against the kernel's key tile of 128 rows: a page that holds whole key tiles is one
# TMA box per block; a page of 16-64 rows that divides the tile is one TMA box per page; any other
# size is *gathered*: the producer's warps look up each row's page and copy the rows with 16-byte
# `cp.async` (`stage3_fwd_kernel/hopper/gather.py`).

# %%
from fa4._layouts import gather_pages
from stage3_fwd_kernel.components.paged_kv import gathered, tma_pages

for page_size in (1, 8, 16, 24, 64, 128, 160, 256):
    reader = ("TMA, one box per key block" if page_size % 128 == 0 else
              "TMA, one box per page" if tma_pages(page_size, 128) else "cp.async row gather")
    assert gathered(page_size, 128) == (reader == "cp.async row gather")
    print(f"pages of {page_size:3d} keys: {reader}")

# the table's arithmetic, checked against the copy fa4 makes when it cannot read in place
g = torch.Generator().manual_seed(0)
pool_k = torch.randn(12, 8, 2, 16, generator=g)                  # 12 pages of 8 keys, 2 KV heads, d = 16
table = torch.randperm(12, generator=g)[:6].view(2, 3).to(torch.int32)  # 2 sequences x 3 pages
dense = gather_pages(pool_k, table)                               # (2, 24, 2, 16)
b, j = 1, 13
assert torch.equal(dense[b, j], pool_k[table[b, j // 8], j % 8])
print(f"key {j} of sequence {b}: page {int(table[b, j // 8])}, row {j % 8}")

# %% [markdown]
# The gather splits a 128-row key block between the producer warpgroup's 4 warps, 32 rows each. At
# d = 128 in bf16 a row is 256 bytes, 16 copies of 16 bytes, so 16 lanes share a row and a warp
# instruction copies 2 rows; each lane looks its own row's page up once, and the lanes copying a row
# get its address by a shuffle. Copies in flight bound it, not their count: on an H200 one warp
# gathering the whole block ran decode at 0.2-0.3x of a dense cache, four warps with 8 copies per
# lane in flight at 0.83-0.96x (`docs/measurements.md`). A long prefill over such pages is
# compute-bound, and there fa4 copies the pages into a dense cache instead (0.95x against 0.65x).

# %%
import cutlass

from stage3_fwd_kernel.hopper.gather import lanes_per_row

tpr = lanes_per_row(cutlass.BFloat16, 128)
rows_per_instruction = 32 // tpr
for lane in (0, 15, 16, 31):
    print(f"d = 128: lane {lane:2d} copies bytes {16 * (lane % tpr):3d}-{16 * (lane % tpr) + 15} of row "
          f"{lane // tpr} (+ {rows_per_instruction} per instruction) of its warp's 32 rows")

# %% [markdown]
# ## `torch.compile`: custom ops, no graph break
# Dynamo cannot trace into a CuTe-DSL launch (ctypes, DLPack, a JIT compiler). `fa4` therefore
# registers six `torch.library` custom ops (for attention and its gradients `fa4::fwd`, `fa4::bwd`,
# `fa4::varlen_fwd`, `fa4::varlen_bwd`; beside them `fa4::paged_varlen_fwd` and
# `fa4::kvcache_attention`), each with a fake implementation that gives shapes and dtypes, and ties the
# forward to the backward with `register_autograd`. So `torch.compile(fullgraph=True)` traces the
# forward *and* the backward with no graph break — and it can do so here, with meta tensors. The
# custom backend below just records the two graphs AOTAutograd produces.

# %%
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

graphs = {}


def record(name):
    def compiler(gm, example_inputs):
        graphs[name] = gm
        return make_boxed_func(gm.forward)
    return compiler


def loss_fn(q, k, v):
    out, lse = fa4.flash_attn_func(q, k, v, causal=True, return_lse=True)
    return out.float().square().mean() + lse.mean()


qg, kg, vg = (t.clone().requires_grad_() for t in (meta(2, 256, 8, 128), meta(2, 256, 2, 128), meta(2, 256, 2, 128)))
torch._dynamo.reset()
t0 = time.time()
loss = torch.compile(loss_fn, fullgraph=True, backend=aot_autograd(fw_compiler=record("forward"),
                                                                   bw_compiler=record("backward")))(qg, kg, vg)
loss.backward()
print(f"traced forward + backward in {time.time() - t0:.1f} s; q.grad {tuple(qg.grad.shape)}")
for name, gm in graphs.items():
    ops = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    print(f"{name:>8} graph: {len(ops)} ops, fa4 ops: {[o for o in ops if o.startswith('fa4')]}")
explained = torch._dynamo.explain(loss_fn)(qg, kg, vg)
print("graphs:", explained.graph_count, " graph breaks:", explained.graph_break_count)
assert explained.graph_break_count == 0 and any("fa4.bwd" in str(n.target) for n in graphs["backward"].graph.nodes)
torch._dynamo.reset()

# %% [markdown]
# The same works with `torch._subclasses.fake_tensor.FakeTensorMode`, which fakes CUDA tensors on a
# machine without CUDA:

# %%
from torch._subclasses.fake_tensor import FakeTensorMode

with FakeTensorMode():
    fq = torch.empty(3, 50, 4, 64, device="cuda", dtype=torch.float16)
    fout = fa4.flash_attn_func(fq, fq, fq, causal=True)
    print("fake CUDA:", fout.device, tuple(fout.shape), fout.dtype)

# %% [markdown]
# ## The compile cache
# A CuTe-DSL kernel is traced and compiled (MLIR → PTX → ptxas) the first time a configuration is
# used, and every new process pays again. `fa4/_cache.py` keeps kernels at two levels: in memory
# (`stage3_fwd_kernel.compile_cache`, one compile per configuration and process; shapes and
# strides stay dynamic, so one compile serves every size) and on disk, under
# `$FA4_CACHE_DIR/kernels-v2/<fingerprint>/<key hash>-<content hash>.o`:
# - the **key** is the stage module's own compile key: everything that is a compile-time constant
#   of the kernel (step, dtype, head dims, causal, softmax policy, scheduler, varlen flags);
# - the **fingerprint** hashes the kernel sources (stages 2-5), the DSL and TVM-FFI versions, the
#   Python version and `CUTE_DSL_ARCH`: editing a kernel starts a fresh generation, never loads stale code;
# - the **content hash** is checked before loading; a corrupt entry is deleted and rebuilt.
#
# Only launchable compiles (`"gpu"` keys: TVM-FFI builds that take torch tensors, what a launch
# uses) are persisted by the hook; compile-only builds (kept for their resource report) stay in
# memory. A launchable build needs no GPU either, so the cell builds the production forward's for `sm_90a` and
# stores and reloads it by hand, in a temporary `FA4_CACHE_DIR`.

# %%
from fa4 import _cache

tmp = tempfile.mkdtemp(prefix="fa4_cache_demo_")
os.environ["FA4_CACHE_DIR"] = tmp
from stage3_fwd_kernel import host_io, tile_scheduler
from stage3_fwd_kernel import hopper

dt = host_io.cutlass_dtype("bf16")
gpu_key = hopper._key("gpu", dt, 128, 128, True, hopper.DEFAULT_POLICY, tile_scheduler.StaticTileScheduler)
fake_key = hopper._key("fake", dt, 128, 128, True, hopper.DEFAULT_POLICY, tile_scheduler.StaticTileScheduler)
print("compile key :", gpu_key)
print("key hash    :", _cache.key_hash(gpu_key), "| persisted:", _cache.persistable(gpu_key),
      "| the fake-tensor twin persisted:", _cache.persistable(fake_key))
print("fingerprint :", _cache.fingerprint(), f"(arch {os.environ['CUTE_DSL_ARCH']})")

t0 = time.time()
comp = hopper.compile_only("bf16", 128, 128, causal=True, launchable=True)  # the compile under gpu_key
t_compile = time.time() - t0
store = _cache.DiskCache(_cache.cache_dir())
path = store.store(gpu_key, comp.fn, comp.report)
t0 = time.time()
fn, loaded = store.load(gpu_key)
t_load = time.time() - t0
print(f"compile {t_compile:.2f} s  vs  load from disk {t_load * 1e3:.1f} ms  ({type(fn).__name__})")
print("on disk:", sorted(p.relative_to(tmp).as_posix() for p in pathlib.Path(tmp).rglob("*") if p.is_file()))
print("report kept beside it:", {k: v for k, v in store.read_report(_cache.key_hash(gpu_key)).items()
                                 if k in ("registers", "smem_bytes", "HGMMA")})
assert loaded == path and path.name.startswith(_cache.key_hash(gpu_key))
_cache.clear()
shutil.rmtree(tmp, ignore_errors=True)
del os.environ["FA4_CACHE_DIR"]

# %% [markdown]
# On a GPU the hook does this by itself: the first call of a configuration compiles and writes
# the object, later processes load it. `python -m fa4 precompile` fills the cache ahead of time,
# `python -m fa4 info` shows where it is and how big, `python -m fa4 cache clear --stale` removes
# old generations, and `FA4_CACHE=0` keeps everything in memory.
#
# ## A small model: fa4 against SDPA (on a GPU)
# One attention block (projections, rotary-free GQA attention, output projection) whose attention
# is torch SDPA or `fa4.scaled_dot_product_attention`, with the same weights. FA4's own rule
# judges fa4: against an fp32 SDPA reference, its error in output and every gradient is at most
# twice that of bf16 SDPA. Without a Hopper GPU the cell only traces the fa4 model on meta tensors.

# %%
from torch import nn


class Block(nn.Module):
    def __init__(self, dim=1024, heads=8, kv_heads=2, head_dim=128, attn="sdpa"):
        super().__init__()
        self.h, self.hkv, self.d, self.attn = heads, kv_heads, head_dim, attn
        self.wq = nn.Linear(dim, heads * head_dim, bias=False)
        self.wkv = nn.Linear(dim, 2 * kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(heads * head_dim, dim, bias=False)

    def forward(self, x):  # x (B, S, dim)
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.h, self.d).transpose(1, 2)                    # (B, H, S, D)
        k, v = self.wkv(x).view(b, s, 2, self.hkv, self.d).permute(2, 0, 3, 1, 4)  # (B, Hkv, S, D) each
        sdpa = fa4.scaled_dot_product_attention if self.attn == "fa4" else F.scaled_dot_product_attention
        o = sdpa(q, k, v, is_causal=True, enable_gqa=True)                           # (B, H, S, D)
        return x + self.wo(o.transpose(1, 2).reshape(b, s, -1))


on_hopper = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
if not on_hopper:
    model = Block(attn="fa4").to(device="meta", dtype=torch.bfloat16)
    x = meta(2, 512, 1024).requires_grad_()
    ex = torch._dynamo.explain(model)(x)
    print(f"no Hopper GPU: the fa4 model traced on meta tensors, {ex.graph_count} graph, "
          f"{ex.graph_break_count} graph breaks")
    torch._dynamo.reset()
else:
    from stage0_reference.torch_reference import assert_fa4_close

    torch.manual_seed(0)
    ref_model = Block(attn="sdpa").cuda()                                # fp32 SDPA: the reference
    models = {"bf16 SDPA": Block(attn="sdpa"), "bf16 fa4": Block(attn="fa4")}
    for m in models.values():
        m.load_state_dict(ref_model.state_dict())
        m.to("cuda", torch.bfloat16)
    x = torch.randn(2, 2048, 1024, device="cuda")
    results = {}
    for name, m in [("fp32 SDPA", ref_model)] + list(models.items()):
        xi = x.to(next(m.parameters()).dtype).requires_grad_()
        y = m(xi)
        y.float().square().mean().backward()
        results[name] = [y.detach(), xi.grad] + [p.grad for p in m.parameters()]
    ref, base, ours = results["fp32 SDPA"], results["bf16 SDPA"], results["bf16 fa4"]
    for label, a, r, b in zip(["output", "dx"] + [n for n, _ in ref_model.named_parameters()], ours, ref, base):
        err, bound = assert_fa4_close(label, a, r, b)
        print(f"{label:<10} fa4 error {err:.2e} <= bound {bound:.2e}")

    def time_ms(m, reps=20):
        xi = x.to(torch.bfloat16).requires_grad_()
        for _ in range(3):
            m(xi).float().square().mean().backward()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            m(xi).float().square().mean().backward()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / reps

    for name, m in models.items():
        print(f"{name}: forward + backward {time_ms(m):.3f} ms ({torch.cuda.get_device_name()})")

# %% [markdown]
# ## Exercise
# A decoder generates with a KV cache: 4 new queries attend to a cache of 10 keys, of which the
# last 4 are the new tokens. (1) Which keys does query 0 see with `fa4.flash_attn_func(...,
# causal=True)`, and which with `fa4.scaled_dot_product_attention(..., is_causal=True)`? Which one
# is right for decoding? (2) Three requests of 6, 1 and 4 new tokens are packed for
# `flash_attn_varlen_func`: write `cu_seqlens_q` and the rows of the third request.
#
# <details><summary>Answer</summary>
#
# (1) Bottom-right: query `i` sees keys `j <= i + Sk - Sq = i + 6`, so query 0 sees keys 0-6 — the
# whole cache plus itself, as decoding needs. Top-left (SDPA's): query 0 sees key 0 only. Use
# `flash_attn_func` for decoding; the SDPA helper exists to reproduce SDPA bit-for-bit semantics.
# (2) `cu_seqlens_q = [0, 6, 7, 11]`; the third request owns rows 7:11.
# </details>

# %%
bottom_right = visible_mask(4, 10, causal=True)
assert np.flatnonzero(bottom_right[0]).tolist() == list(range(7))
assert np.flatnonzero(np.tril(np.ones((4, 10), dtype=bool))[0]).tolist() == [0]  # SDPA's top-left
_, cu_ex, _ = pack([torch.zeros(n, 1, 1) for n in (6, 1, 4)])
assert cu_ex.tolist() == [0, 6, 7, 11] and (cu_ex[2].item(), cu_ex[3].item()) == (7, 11)
print("query 0 sees keys", np.flatnonzero(bottom_right[0]).tolist(), "| cu_seqlens_q", cu_ex.tolist())

# %% [markdown]
# **Next**: [07 · decoding](07_decoding.ipynb), the split-KV launch behind `flash_attn_with_kvcache`;
# `fa4/README.md` for the whole API, the command line (`python -m fa4 demo | info |
# precompile | cache`) and the transformers integration; or back to
# [00 · the reference](00_reference.ipynb), the float64 oracle every number above is judged against.
