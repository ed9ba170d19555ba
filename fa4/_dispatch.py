"""Which kernel runs where: the support tables, `supported()`, and dispatch by device capability.

Everything fa4 claims to support is written down once, here, as data (`ARCHS`, `DTYPES`,
`FEATURES`): validation reads the head-dim tables, dispatch reads the module names, and
`supported()` turns the same tables into the report that `python -m fa4 info` prints and that
generates the support matrix in fa4/README.md (`python -m fa4 info --markdown`). A README line
can therefore not claim more than the code does.

Kernels come from the stable entry modules of the stage packages, imported by name in one
`Backend` subclass per architecture (`HopperBackend`, `BlackwellBackend`), which also knows how
its modules are called. fa4 never imports them at module import time:
  * importing a CuTe-DSL module imports `cutlass`, which fixes the target arch for the whole
    process (CUTE_DSL_ARCH is read once), so the device picks the arch first
    (`stage2_emulated_exp.cute_arch.retarget`);
  * a machine without a GPU must still be able to `import fa4`, print `supported()` and trace
    models with fake tensors.
The first kernel import also puts fa4's disk cache behind the stages' compile cache
(`stage3_fwd_kernel.compile_cache.set_store`).

Nothing here falls back to a slow reference implementation: a kernel that fails to import is an
error, because a silent 50x slowdown in training is worse than a crash.
"""
from __future__ import annotations

import dataclasses
import functools
import sys
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

from . import _plans

# ---------------------------------------------------------------------------------------------
# 1. the support tables
# ---------------------------------------------------------------------------------------------
DTYPES = ("float16", "bfloat16")


@dataclass(frozen=True)
class ArchInfo:
    key: str                      # "sm_90"
    gpus: str                     # marketing names, for humans
    capabilities: tuple           # torch.cuda.get_device_capability() values served by this entry
    cute_arch: str                # what CUTE_DSL_ARCH must be when cutlass is imported
    hardware_status: str          # "verified" or "unverified"
    head_dims: tuple              # supported (head_dim_qk, head_dim_v) pairs
    forward_module: str           # forward and varlen forward (imported by the arch's Backend)
    backward_module: str          # backward and varlen backward
    note: str = ""
    lacks: tuple = ()             # FEATURES this arch does not have (supported() reports them per arch)
    backward_head_dims: tuple = ()  # the backward's pairs where fewer than head_dims (empty: the same)


# The head-dim lists are the kernels' own (SUPPORTED_HEAD_DIMS of stage3_fwd_kernel.hopper,
# stage4_bwd_kernel.common and stage3_fwd_kernel.blackwell_config), copied so that this table can
# be read without importing cutlass; tests/test_fa4_api.py fails when they drift apart.
ARCHS: dict[str, ArchInfo] = {
    "sm_90": ArchInfo(
        key="sm_90", gpus="Hopper: H100, H200, H20", capabilities=((9, 0),), cute_arch="sm_90a",
        hardware_status="verified",
        head_dims=((64, 64), (96, 96), (128, 128), (128, 64), (192, 128), (256, 256)),
        forward_module="stage3_fwd_kernel.hopper",
        backward_module="stage4_bwd_kernel.hopper",
        note="run and tested on H100 and H200 GPUs",
    ),
    "sm_100": ArchInfo(
        key="sm_100", gpus="Blackwell: B200, GB200", capabilities=((10, 0),), cute_arch="sm_100a",
        hardware_status="unverified",
        head_dims=((64, 64), (96, 96), (128, 128), (128, 64), (192, 128), (256, 256)),
        forward_module="stage3_fwd_kernel.blackwell_fwd",
        backward_module="stage4_bwd_kernel.blackwell",
        # sm_100a code uses arch-specific instructions (tcgen05, TMEM): it runs on compute
        # capability 10.0 only, not on 10.3 (B300) or 12.x (RTX 50xx), hence no wider match.
        note="compiled for sm_100a in CI and checked structurally; no Blackwell GPU is reachable here",
    ),
}

# Features: name -> (supported?, how). Unsupported ones are listed so that users get the answer
# from `fa4.supported()` instead of from a wrong result.
FEATURES: dict[str, tuple[bool, str]] = {
    "causal": (True, "bottom-right aligned when seqlen_q != seqlen_k (FlashAttention convention); "
                     "fa4.scaled_dot_product_attention keeps SDPA's top-left convention"),
    "gqa_mqa": (True, "heads_q % heads_kv == 0"),
    "varlen": (True, "flash_attn_varlen_func: packed (total_tokens, heads, head_dim), int32 cu_seqlens"),
    "seqused_k": (True, "varlen only: use the first seqused_k[b] keys of each sequence"),
    "seqused_q": (True, "varlen only: use the first seqused_q[b] query rows (later rows: out 0, lse -inf, no "
                        "gradient); run as 2 x batch sequences, the unused rows against no keys (fa4/_layouts.py)"),
    "padded_varlen": (True, "flash_attn_varlen_func takes either side padded, (batch, seqlen, heads, head_dim) with "
                            "its cu_seqlens None, in any combination with seqused_q / seqused_k"),
    "any_head_dim": (True, "qk and v head dims: any multiples of 8 up to 256; a pair without a kernel of its own "
                           "runs on the cheapest native pair that covers it, zero-padded (flash_attn_func, "
                           "flash_attn_varlen_func; flash_attn_with_kvcache reads the cache in place and takes only "
                           "the native pairs)"),
    "return_lse": (True, "natural-log logsumexp of the scaled scores, fp32, (B, H, Sq) / (H, total_q)"),
    "lse_gradient": (True, "dlse enters the backward as a D-term correction: dS += P * dlse"),
    "deterministic_backward": (True, "deterministic=True, forwarded to the backward kernel"),
    "torch_compile": (True, "torch.library custom ops fa4::fwd / fa4::bwd (+ varlen): fullgraph, no graph break"),
    "cuda_graphs": (True, "capture after one warm-up call (kernels compile on first use)"),
    "disk_compile_cache": (True, "compiled kernels persisted per config (FA4_CACHE_DIR); see fa4/README.md"),
    "attn_mask": (False, "arbitrary masks are not supported: use causal or varlen (padding)"),
    "dropout": (False, "attention dropout is not supported"),
    "sliding_window": (True, "window_size=(left, right): row i sees keys i + off - left ..= i + off + right, "
                             "off = seqlen_k - seqlen_q; None or -1 = unlimited; combines with causal (right = 0)"),
    "softcap": (True, "softcap > 0: scaled scores become softcap * tanh(s / softcap) (Gemma 2), in the backward too"),
    "learnable_sink": (True, "learnable_sink (heads_q,): one logit per query head joins each row's softmax "
                             "denominator (gpt-oss); differentiable, lse includes it"),
    "paged_kv_cache": (True, "block_table / page_table: read in place by the sm_90 forward when nothing needs a "
                             "gradient -- pages of 16, 32, 64 or a multiple of 128 keys (64 at head dim 256) by TMA, "
                             "any other page size by a cp.async gather up to 256 query rows (decode, short chunks); "
                             "longer queries over those pages, queries over pages of 16 with 6144 or more query-head "
                             "rows a key and KV head (head dims up to 192; at 256 the 64-key tile holds 4 such "
                             "pages, which stay in place) use a dense copy of the pages; on sm_100 pages of 16, 32, 64 or a "
                             "multiple of 128 keys are read in place by TMA (not 16-64 at head dims 192/128; pages "
                             "of 16 by the same head-row rule), others copied"),
    "kv_cache": (True, "flash_attn_with_kvcache: dense or paged cache, in-place append with rotary embedding, "
                       "cache_batch_idx, cache_leftpad (dense caches: each sequence's keys from its own row), split-KV "
                       "decode merged through the lse -- on sm_90 by its split launch (each CTA finds its key chunk), "
                       "on other arches by key segments of the varlen forward (fa4/_kvcache.py); on sm_90 "
                       "calls of at most 64 query tokens a sequence that need no gradient take the same split "
                       "launch: flash_attn_func, and flash_attn_varlen_func with page_table or with q, k and v "
                       "padded, without seqused_q (fa4/_decode_route.py)"),
    "fp8": (False, "not supported"),
}


def has_backward(arch: ArchInfo, d: int, dv: int) -> bool:
    """Whether the arch's backward serves the native pair (d, dv) (its forward may serve more)."""
    return not arch.backward_head_dims or (d, dv) in arch.backward_head_dims


def all_head_dims() -> tuple:
    """Head-dim pairs supported on at least one arch (what validation accepts before dispatch)."""
    seen: list = []
    for a in ARCHS.values():
        for hd in a.head_dims:
            if hd not in seen:
                seen.append(hd)
    return tuple(sorted(seen))


def arch_has(arch: ArchInfo, feature: str) -> bool:
    """Whether `feature` (a FEATURES key) works on `arch`."""
    return FEATURES[feature][0] and feature not in arch.lacks


def supported() -> dict:
    """What runs where, as data: archs, dtypes, head dims, features, and the kernel module of each
    role (named, not imported). A feature's "supported" is True when some arch has it; "archs"
    says which (each arch's own "features" says the same from its side).

    This dict is the single source of the support matrix in fa4/README.md (regenerate it with
    ``python -m fa4 info --markdown --update-readme``)."""
    archs = {}
    for a in ARCHS.values():
        archs[a.key] = {
            "gpus": a.gpus,
            "compute_capabilities": [f"{m}.{n}" for m, n in a.capabilities],
            "cute_arch": a.cute_arch,
            "hardware": a.hardware_status,
            "note": a.note,
            "head_dims": [list(hd) for hd in a.head_dims],
            "backward_head_dims": [list(hd) for hd in (a.backward_head_dims or a.head_dims)],
            "forward": a.forward_module,
            "varlen_forward": a.forward_module,
            "backward": a.backward_module,
            "features": {name: arch_has(a, name) for name in FEATURES},
        }
    features = {}
    for name, (_, how) in FEATURES.items():
        per_arch = {a.key: arch_has(a, name) for a in ARCHS.values()}
        features[name] = {"supported": any(per_arch.values()), "archs": per_arch, "how": how}
    return {
        "archs": archs,
        "dtypes": list(DTYPES),
        "features": features,
        "devices_refused": "CPU tensors and any GPU whose compute capability is not listed above",
    }


# ---------------------------------------------------------------------------------------------
# 2. the support matrix as markdown (README block) -- generated, never typed
# ---------------------------------------------------------------------------------------------
README_BEGIN = "<!-- fa4-support-matrix:begin (generated by `python -m fa4 info --markdown`; do not edit) -->"
README_END = "<!-- fa4-support-matrix:end -->"


def _hd(pairs) -> str:
    return ", ".join(f"{d}" if d == dv else f"{d}/{dv}" for d, dv in pairs)


def support_markdown(info: Optional[dict] = None) -> str:
    """The README's support matrix, rendered from `supported()`."""
    info = supported() if info is None else info
    lines = [README_BEGIN, "", "| | " + " | ".join(f"{k} ({v['gpus']})" for k, v in info["archs"].items()) + " |",
             "|---|" + "---|" * len(info["archs"])]

    def row(label, fn):
        lines.append(f"| {label} | " + " | ".join(fn(v) for v in info["archs"].values()) + " |")

    row("hardware", lambda v: "verified on hardware" if v["hardware"] == "verified"
        else "**unverified on hardware** (compile-only)")
    row("compute capability", lambda v: ", ".join(v["compute_capabilities"]) + f" (built for `{v['cute_arch']}`)")
    row("head dims (qk/v)", lambda v: _hd(tuple(h) for h in v["head_dims"]))
    row("backward head dims", lambda v: "the same" if v["backward_head_dims"] == v["head_dims"]
        else _hd(tuple(h) for h in v["backward_head_dims"]))
    row("dtypes", lambda v: ", ".join(info["dtypes"]))
    row("forward kernel", lambda v: f"`{v['forward']}`")
    row("varlen forward", lambda v: f"`{v['varlen_forward']}`")
    row("backward kernel", lambda v: f"`{v['backward']}`")
    keys = list(info["archs"])
    lines += ["", "| feature | " + " | ".join(keys) + " | how |", "|---|" + "---|" * len(keys) + "---|"]
    for name, f in info["features"].items():
        marks = " | ".join("yes" if f["archs"][k] else "no" for k in keys)
        lines.append(f"| {name} | {marks} | {f['how']} |")
    lines += ["", f"Refused with an error: {info['devices_refused']}.", "", README_END]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# 3. dispatch
# ---------------------------------------------------------------------------------------------
class UnsupportedDeviceError(ValueError):
    """The tensors live on a device fa4 has no kernel for (CPU, or an unlisted GPU)."""


def supported_devices_text() -> str:
    return "; ".join(f"{a.key} ({a.gpus}; compute capability "
                     + ", ".join(f"{m}.{n}" for m, n in a.capabilities)
                     + ("" if a.hardware_status == "verified" else "; unverified on hardware") + ")"
                     for a in ARCHS.values())


def arch_for_capability(cap) -> ArchInfo:
    for a in ARCHS.values():
        if tuple(cap) in a.capabilities:
            return a
    raise UnsupportedDeviceError(
        f"q: fa4 has no kernel for compute capability {cap[0]}.{cap[1]}. Supported: {supported_devices_text()}.")


_BLACKWELL_WARNED = False
_LOCK = threading.Lock()


def _ensure_cute_arch(arch: ArchInfo):
    """CuTe-DSL reads CUTE_DSL_ARCH once, when `cutlass` is first imported. Target this device
    before any stage module imports cutlass (over the stage packages' sm_90a default, not over a
    value the user exported); if cutlass is already in and targets a different arch, say so
    (compiling sm_90a code for a B200 would fail at launch)."""
    from stage2_emulated_exp import cute_arch

    current = cute_arch.retarget(arch.cute_arch)
    if current is not None and current != arch.cute_arch:
        raise RuntimeError(
            f"fa4: this device is {arch.key} but CuTe-DSL targets CUTE_DSL_ARCH={current}. Unset "
            f"CUTE_DSL_ARCH (or set it to {arch.cute_arch}) before anything imports cutlass.")


# Causal dense forwards with at least this many keys launch stage 5's LPT tile order on Hopper
# instead of the kernel's static grid. Paired rounds on an H100 (production forward, d = 64 / 128;
# docs/measurements.md): +1..+4% from 4k keys up, -2% at 2k.
LPT_MIN_SEQLEN_K = 4096

# LPT sections over the (batch, head) pairs in a row, as the official FA4 kernel cuts them, instead of
# inside each batch: when the section size does not divide the head count (10 heads at (192, 128) in
# sections of 4), every batch then ended with a narrow section whose longest tiles start too late.
# Both are the same order where it divides. H100: (192, 128) causal, 4 x 10 heads at 8k, idle tail
# 44 -> 11.5 us; paired rounds +5.9% at 4k, +2.4% at 8k (docs/measurements.md, "Flat sections").
FORWARD_LPT_FLAT = True

# The share of the L2 that an LPT section's K/V may fill (stage5_scheduling.orders.heads_per_section's
# `safety`, a modelling choice). The official FA4 kernel (flash-attn-4 4.0.0b36, SingleTileLPTScheduler)
# sizes its sections for all of a 50 MiB L2, i.e. twice ours (the A/B harness's `fa4~lpt_safety=1.0`
# route times that).
FORWARD_LPT_L2_SAFETY = 0.5

# Query tiles of 64 rows (one consumer warpgroup, stage3_fwd_kernel.hopper's tile_m=64) for forwards whose
# query sequences all have <= this many rows: decode (one token, or a GQA group packed into rows) and
# short chunks, where a 128-row tile computes mostly padding. None = the head dims' default tile.
SHORT_QUERY_TILE_M = 64

# flash_attn_func / flash_attn_varlen_func calls of at most this many query tokens a sequence that need no
# gradient run on flash_attn_with_kvcache's split launch (fa4/_decode_route.py): decode steps. None = off
# (every call on the forward above; the decode benchmark's `fa4_func_unrouted` peer). 64: the split
# launch's one short-query tile (fa4._kvcache.PACKED_CAUSAL_ROWS).
DECODE_ROUTE_MAX_QUERY = 64


def short_query_tile(max_rows: int) -> Optional[int]:
    """tile_m for a forward whose sequences have at most max_rows query rows (None: the default)."""
    if SHORT_QUERY_TILE_M is not None and isinstance(max_rows, int) and max_rows <= SHORT_QUERY_TILE_M:
        return SHORT_QUERY_TILE_M
    return None


# Persistent CTAs for the forward: None = the forward module's own default (Hopper: one CTA
# per SM walking the tile order wherever Q, O and two K/V stages fit, head dims <= 128); True /
# False force it (the A/B harness's `fa4~persistent=False` route compares the two).
FORWARD_PERSISTENT = None


@functools.lru_cache(maxsize=256)
def causal_forward_scheduler(arch_key: str, causal: bool, seqlen_k: int, head_dim: int, head_dim_v: int,
                             heads_q: int, heads_kv: int, l2_bytes: Optional[int] = None, softcap: bool = False,
                             sink: bool = False):
    """The tile scheduler of a dense forward: None (the kernel's static grid) or stage 5's
    `LPTCausalScheduler.from_problem` (sections of heads whose K/V fit in L2, longest tiles first).
    Its section size is a compile-time constant, so each size class is its own kernel (compiled on
    first use, then served by the disk cache). None also where stage 3 walks the call's tile in the
    grid's order (`grid_order_causal`; softcap / sink: the call has one). Measured on sm_90 (sections
    sized for an H100's 50 MiB L2); on sm_100 (never run here) sized by the device's own L2 (`l2_bytes`), as the official
    kernel orders its causal tiles longest first there too."""
    if arch_key not in ("sm_90", "sm_100") or not causal or seqlen_k < LPT_MIN_SEQLEN_K:
        return None
    if arch_key == "sm_90":
        from stage3_fwd_kernel.hopper.config import grid_order_causal

        if grid_order_causal(head_dim, head_dim_v, seqlen_k, softcap, sink):  # d = 96 from 8192 keys: LPT spills
            return None
    from stage5_scheduling import orders
    from stage5_scheduling.device import LPTCausalScheduler  # imports cutlass: after the arch is set

    l2 = orders.H100_L2_BYTES if arch_key == "sm_90" or not l2_bytes else l2_bytes
    return LPTCausalScheduler.from_problem(seqlen_k, head_dim, heads_q, heads_kv, head_dim_v=head_dim_v,
                                           l2_bytes=l2, safety=FORWARD_LPT_L2_SAFETY,
                                           flat_batches=FORWARD_LPT_FLAT)


def lpt_for_grid(sched, seqlen_q: int, heads_q: int, batch: int):
    """`sched` for a grid of this size. The flat LPT map finds a CTA's tile with fast_div, exact below
    FAST_DIV_MAX (2^22) tiles; a bigger grid (e.g. 32k sequences x 128 heads) takes the same sections
    batch by batch, whose map divides exactly, instead of being refused. Counted with the smallest
    query tile (64 rows), so no tile size the kernel picks can pass the bound."""
    if sched is None or not getattr(sched, "flat_batches", False):
        return sched
    from stage3_fwd_kernel.intdiv import FAST_DIV_MAX

    if -(-seqlen_q // 64) * heads_q * batch < FAST_DIV_MAX:
        return sched
    return dataclasses.replace(sched, flat_batches=False)


def lpt_forward_schedulers(arch_key: str, head_dim: int, head_dim_v: int, heads_q: int, heads_kv: int,
                           max_seqlen_k: int, softcap: bool = False, sink: bool = False,
                           l2_bytes: Optional[int] = None) -> list:
    """Every scheduler `causal_forward_scheduler` picks for a causal call of these heads with
    LPT_MIN_SEQLEN_K..max_seqlen_k keys, as (first_seqlen_k, last_seqlen_k, scheduler), shortest
    first: the LPT kernels `python -m fa4 precompile --heads` builds. The section size falls
    monotonically with the key count, so each scheduler owns one contiguous range; bisection finds
    its end (about 17 picks per range instead of one per length). The ranges stop where the pick
    turns None (lengths whose tile stage 3 walks in the grid's order, `grid_order_causal`). l2_bytes:
    sm_100's sections follow the device's L2 (`causal_forward_scheduler`); sm_90 ignores it."""
    pick = functools.partial(causal_forward_scheduler.__wrapped__,  # uncached: the probes would flood the cache
                             l2_bytes=l2_bytes)
    ranges = []
    first = LPT_MIN_SEQLEN_K
    while first <= max_seqlen_k:
        sched = pick(arch_key, True, first, head_dim, head_dim_v, heads_q, heads_kv, softcap=softcap, sink=sink)
        if sched is None:
            break
        lo, hi = first, max_seqlen_k  # invariant: pick(lo) == sched
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if pick(arch_key, True, mid, head_dim, head_dim_v, heads_q, heads_kv, softcap=softcap, sink=sink) == sched:
                lo = mid
            else:
                hi = mid - 1
        ranges.append((first, lo, sched))
        first = lo + 1
    return ranges


@dataclass
class Backend:
    """The kernels of one arch, imported on first use. All methods take CUDA tensors that
    `fa4._validate` has already checked. Subclasses name their modules (`import_forward`,
    `import_backward`) and call them (`_call_forward`, `_call_varlen_forward`)."""
    arch: ArchInfo
    _mods: dict = field(default_factory=dict)  # role ("fwd" / "bwd") -> imported module

    # the modules offer compile_launchable(...): what the GPU path launches, built without a GPU
    # under its cache keys (fa4.precompile); the forward's also takes a tile scheduler
    LAUNCHABLE_BUILDS = False
    # precompile also builds what long calls launch: the LPT-ordered causal forwards (--heads; their
    # section size is sized for an H100's L2), the split-tail forward, the persistent backward. sm_100's
    # LPT sections follow the device's own L2: precompile builds them only given it (--l2-bytes, or on
    # a Blackwell GPU), else its long causal calls compile on first use
    AHEAD_LONG_BUILDS = False
    # the dense backward hands back D = rowsum(dout * out) - dlse (`return_d`) from its preprocess;
    # else sink_grad computes it with torch
    DENSE_BACKWARD_RETURNS_D = True
    # the forward module has attention_split_forward: a split-KV launch whose CTAs find their key chunk
    # themselves (flash_attn_with_kvcache's decode); else the cache is cut into key segments of the
    # varlen forward (fa4._kvcache)
    SPLIT_KV_LAUNCH = False

    def _module(self, role: str) -> Any:
        if role not in self._mods:
            with _LOCK:
                if role not in self._mods:
                    _ensure_cute_arch(self.arch)
                    name = self.arch.forward_module if role == "fwd" else self.arch.backward_module
                    try:
                        mod = self.import_forward() if role == "fwd" else self.import_backward()
                    except ImportError as exc:
                        raise RuntimeError(f"fa4: importing {name} ({role} on {self.arch.key}) failed: {exc}") from exc
                    _install_disk_cache()
                    self._mods[role] = mod
        return self._mods[role]

    def import_forward(self):
        raise NotImplementedError

    def import_backward(self):
        raise NotImplementedError

    def check_head_dims(self, d: int, dv: int, names=("q", "v")):
        if (d, dv) not in self.arch.head_dims:
            raise ValueError(
                f"{names[0]}: head dims (qk={d}, v={dv}) are not supported on {self.arch.key}; supported: "
                f"{_hd(self.arch.head_dims)}")

    def check_backward_head_dims(self, d: int, dv: int):
        """Before any backward launch: the pairs whose forward runs but whose backward does not."""
        if not has_backward(self.arch, d, dv):
            raise ValueError(f"q: head dims (qk={d}, v={dv}) have a forward but no backward on {self.arch.key} "
                             f"(compiled backward pairs: {_hd(self.arch.backward_head_dims)}); run it without "
                             "gradients")

    # the variants: feature name in FEATURES / ArchInfo.lacks -> the argument that asks for it
    VARIANT_ARGS = (("sliding_window", "window_size"), ("softcap", "softcap"), ("learnable_sink", "learnable_sink"))

    def check_variants(self, window=(None, None), softcap=0.0, learnable_sink=None):
        """Refuse (ValueError naming the argument) a variant this arch's kernels do not implement,
        before anything is imported or launched."""
        used = {"window_size": tuple(window) != (None, None), "softcap": softcap != 0.0,
                "learnable_sink": learnable_sink is not None}
        for feature, arg in self.VARIANT_ARGS:
            if used[arg] and feature in self.arch.lacks:
                have = ", ".join(a.key for a in ARCHS.values() if arch_has(a, feature))
                raise ValueError(f"{arg}: not implemented on {self.arch.gpus.split(':')[0]} ({self.arch.key}); "
                                 f"supported on {have or 'no arch'}")

    def _warn_unverified(self):
        global _BLACKWELL_WARNED
        if self.arch.hardware_status != "verified" and not _BLACKWELL_WARNED:
            _BLACKWELL_WARNED = True
            warnings.warn(
                f"fa4: running the {self.arch.key} ({self.arch.gpus}) kernels, which are compiled and checked "
                "structurally in CI but have never run on hardware in this project (unverified). "
                "Compare against torch SDPA before trusting results.", RuntimeWarning, stacklevel=4)

    # -- forward ------------------------------------------------------------------------------
    def forward_module(self):
        return self._module("fwd")

    def forward(self, q, k, v, softmax_scale: float, causal: bool, window=(None, None), softcap: float = 0.0,
                learnable_sink=None):
        """window = (left, right): None or ints >= 0 (fa4._validate.check_window's form: a causal
        call has right None). The variants reach the kernel only when not at their defaults. A call
        with a launch plan (fa4._plans) replays it without importing the kernel modules."""
        self.check_variants(window, softcap, learnable_sink)
        self._warn_unverified()
        inputs = (q, k, v, learnable_sink)
        sig = self._plan_signature("fwd", inputs, (softmax_scale, causal, tuple(window), softcap))
        done = _plans.replay(sig, self.arch.cute_arch, inputs)
        if done is not None:
            return done
        mod = self.forward_module()
        with _plans.recording(sig, self.arch.cute_arch, inputs) as record:
            result = self._call_forward(mod, q, k, v, softmax_scale, causal,
                                        **variant_kwargs(window, softcap, learnable_sink))
            record(result)
        return result

    def _plan_signature(self, role: str, tensors: tuple, scalars: tuple):
        """The launch-plan signature of a dense call (None where plans are off, or while the stage
        kernels are built with clock stamps: stage3_fwd_kernel.trace, never imported here)."""
        trace = sys.modules.get("stage3_fwd_kernel.trace")
        if not _plans.enabled() or getattr(trace, "_address", 0):
            return None
        switches = (LPT_MIN_SEQLEN_K, FORWARD_LPT_FLAT, FORWARD_LPT_L2_SAFETY, SHORT_QUERY_TILE_M, FORWARD_PERSISTENT)
        return _plans.signature(role, self.arch.key, tensors, scalars, switches)

    def varlen_forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
                       softmax_scale: float, causal: bool, window=(None, None), softcap: float = 0.0,
                       learnable_sink=None, page_table=None):
        """page_table: k / v are a paged cache read in place (only where `paged_in_place` allows it)."""
        self.check_variants(window, softcap, learnable_sink)
        if seqused_k is not None and "seqused_k" in self.arch.lacks:  # before the module's import
            raise ValueError(f"seqused_k: not implemented by the {self.arch.key} varlen forward "
                             f"({self.arch.forward_module})")
        mod = self.forward_module()
        self._warn_unverified()
        kw = variant_kwargs(window, softcap, learnable_sink)
        if page_table is not None:
            kw["page_table"] = page_table
        return self._call_varlen_forward(mod, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
                                         max_seqlen_k, softmax_scale, causal, **kw)

    def paged_in_place(self, head_dim: int, head_dim_v: int, page_size: int, query_rows=None,
                       head_rows=None) -> bool:
        """Whether this arch's varlen forward reads a paged cache of page_size in place (else fa4
        gathers the pages into a dense copy first); query_rows: the kernel's rows for the longest
        sequence; head_rows: query-head rows per KV head attending an average key (fa4._paged.head_rows).
        None: unknown."""
        return False

    # -- backward -----------------------------------------------------------------------------
    def backward_module(self):
        return self._module("bwd")

    def backward(self, dout, q, k, v, out, lse, softmax_scale, causal, deterministic, dlse=None,
                 window=(None, None), softcap: float = 0.0, want_d: bool = False):
        """dlse (the gradient flowing in through lse) goes to the kernel module, whose preprocess
        subtracts it from D (dS = P (dP - (D - dlse)); stage4_bwd_kernel/preprocess.py). A learnable sink
        needs nothing here: the saved lse includes it, which is all the kernel needs for P (its
        own gradient is `sink_grad`). want_d: also return D = rowsum(dout * out) - dlse in lse's layout,
        which the kernel's preprocess computes (the sink's gradient needs it; where the kernel cannot hand it
        back, DENSE_BACKWARD_RETURNS_D, none is returned and sink_grad forms it)."""
        self.check_variants(window, softcap)
        self.check_backward_head_dims(q.shape[-1], v.shape[-1])
        want_d = want_d and self.DENSE_BACKWARD_RETURNS_D  # D is optional: sink_grad forms it when absent
        self._warn_unverified()
        inputs = (dout, q, k, v, out, lse, dlse)
        sig = self._plan_signature("bwd", inputs, (softmax_scale, causal, deterministic, tuple(window), softcap,
                                                   want_d))
        done = _plans.replay(sig, self.arch.cute_arch, inputs)
        if done is not None:
            return done
        fn = self.backward_module().attention_backward
        kw = dict(softmax_scale=softmax_scale, causal=causal, deterministic=deterministic,
                  **variant_kwargs(window, softcap))
        with _plans.recording(sig, self.arch.cute_arch, inputs) as record:
            dq, dk, dv, *d = fn(q, k, v, out, dout, lse, **kw, **({"return_d": True} if want_d else {}),
                                **({} if dlse is None else {"dlse": dlse}))
            record((dq, dk, dv, *d))
        return (dq, dk, dv, *d)

    def varlen_backward(self, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
                        max_seqlen_k, softmax_scale, causal, deterministic, dlse=None, window=(None, None),
                        softcap: float = 0.0, want_d: bool = False):
        self.check_variants(window, softcap)
        self.check_backward_head_dims(q.shape[-1], v.shape[-1])
        fn = self.backward_module().attention_varlen_backward
        self._warn_unverified()
        kw = dict(seqused_k=seqused_k, softmax_scale=softmax_scale, causal=causal, deterministic=deterministic,
                  **variant_kwargs(window, softcap))

        def call(q_, k_, v_, out_, dout_, lse_, **extra):
            return fn(q_, k_, v_, out_, dout_, lse_, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kw,
                      **extra)

        dq, dk, dv, *d = call(q, k, v, out, dout, lse, **({"return_d": True} if want_d else {}),
                              **({} if dlse is None else {"dlse": dlse}))
        return (dq, dk, dv, *d)


# Page sizes the kernel gathers row by row (cp.async) are read in place only up to this many kernel rows
# per sequence (query tokens, times the group where flash_attn_with_kvcache packs GQA heads). On an
# H200 (GQA 32/8, d = 128, causal; docs/measurements.md, 2026-11-29 and 2026-12-03 "when a paged
# call copies") a decode step (1 token, 4 packed rows) ran at 0.84-0.96x of a dense cache in place
# against 0.30-0.40x through a dense copy; chunks of 32-256 queries at the end of 8k keys over pages
# of 8 at 0.57-0.61x in place against 0.42-0.47x, 512 queries at 0.59x against 0.80x; a causal prefill
# of 4k-8k queries at 0.62-0.68x against 0.95x.
GATHER_MAX_QUERY_ROWS = 256

# Pages read by TMA as this many boxes per key block or more (pages of 16 keys at the 128-key tile) are
# read in place only while fewer than SMALL_PAGE_COPY_HEAD_ROWS query-head rows per KV head attend an
# average key the copy would move (fa4._paged.head_rows); past that a dense copy of the pages pays: the
# copy costs per key and KV head, the in-place reads' extra TMA copies a share of the attention's time,
# which grows with the rows attending each key. On an H200 (GQA 32/8, d = 128, causal, shuffled pages
# of 16; 2026-12-03 "when a paged call copies"), dense time / time, in place against through the copy:
# chunks of 1024 / 2048 / 4096 queries at the end of 16k keys (about 4000 / 7700 / 14300 head rows)
# 0.887 / 0.889, 0.908 / 0.932, 0.900 / 0.961; square prefills of 1024 / 2048 queries (about 2000 /
# 4100) 0.938 / 0.870, 0.937 / 0.924. Pages of 32 (4 boxes) in place 0.965 / 0.977 at 4k / 16k square,
# through the copy 0.958 / 0.976: they stay in place. Only the group of 4 was timed; the rule scales
# with it.
SMALL_PAGE_BOXES = 8
SMALL_PAGE_COPY_HEAD_ROWS = 6144


class HopperBackend(Backend):
    """sm_90: the production kernels behind `stage3_fwd_kernel.hopper` and `stage4_bwd_kernel.hopper`.
    Causal calls with long keys run stage 5's LPT tile order; the route switches above arrive as
    keyword arguments when set."""

    LAUNCHABLE_BUILDS = True
    AHEAD_LONG_BUILDS = True
    SPLIT_KV_LAUNCH = True

    def import_forward(self):
        from stage3_fwd_kernel import hopper

        return hopper

    def import_backward(self):
        from stage4_bwd_kernel import hopper

        return hopper

    def _call_forward(self, mod, q, k, v, softmax_scale, causal, **variants):
        kw = dict(variants)
        tile_m = short_query_tile(q.shape[1])
        # LPT orders tiles by their causal length; a left window makes them (nearly) equal, and a short
        # query has one tile per head: static grid
        lpt = causal and "window_size" not in variants and tile_m is None
        sched = causal_forward_scheduler(self.arch.key, lpt, k.shape[1], q.shape[-1], v.shape[-1], q.shape[2],
                                         k.shape[2], softcap=bool(variants.get("softcap")),
                                         sink=variants.get("learnable_sink") is not None)
        sched = lpt_for_grid(sched, q.shape[1], q.shape[2], q.shape[0])
        if tile_m is not None:
            kw["tile_m"] = tile_m
        if sched is not None:
            kw["scheduler"] = sched
        if FORWARD_PERSISTENT is not None:
            kw["persistent"] = FORWARD_PERSISTENT
        return mod.attention_forward(q, k, v, softmax_scale=softmax_scale, causal=causal, **kw)

    def paged_in_place(self, head_dim: int, head_dim_v: int, page_size: int, query_rows=None,
                       head_rows=None) -> bool:
        """Pages TMA boxes read: always, but for pages of SMALL_PAGE_BOXES boxes a block or more once
        SMALL_PAGE_COPY_HEAD_ROWS head rows attend each key. Pages the producer gathers with cp.async
        (1-8 rows, 24, ...): only for short queries (GATHER_MAX_QUERY_ROWS), where the kernel waits on
        memory. A long prefill is compute-bound and runs faster on a dense copy than on small pieces."""
        from stage3_fwd_kernel.components.paged_kv import box_rows, gathered, page_size_ok
        from stage3_fwd_kernel.hopper.config import default_tile_n

        tile_n = default_tile_n(head_dim, head_dim_v)
        if not page_size_ok(page_size, tile_n):
            return False
        if gathered(page_size, tile_n):
            return query_rows is not None and query_rows <= GATHER_MAX_QUERY_ROWS
        small = tile_n // box_rows(page_size, tile_n) >= SMALL_PAGE_BOXES
        return not (small and head_rows is not None and head_rows >= SMALL_PAGE_COPY_HEAD_ROWS)

    def _call_varlen_forward(self, mod, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
                             softmax_scale, causal, **variants):
        kw = dict(softmax_scale=softmax_scale, causal=causal, **variants)
        if seqused_k is not None:
            kw["seqused_k"] = seqused_k
        if FORWARD_PERSISTENT is not None:
            kw["persistent"] = FORWARD_PERSISTENT
        tile_m = short_query_tile(max_seqlen_q)
        if tile_m is not None:
            kw["tile_m"] = tile_m
        return mod.attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kw)


class BlackwellBackend(Backend):
    """sm_100: `stage3_fwd_kernel.blackwell_fwd` and `stage4_bwd_kernel.blackwell`. Long causal dense
    forwards without a window take stage 5's LPT order (sized by the device's L2), non-causal dense ones
    without a window run on persistent CTAs where that build exists, others the static grid; no route
    switches; its varlen grid is sized from max_seqlen_q alone.
    The variants (window, softcap, sink) reach the kernels as on Hopper; the sink's D comes from
    sink_grad's torch ops (the dense backward does not return it)."""

    DENSE_BACKWARD_RETURNS_D = False
    LAUNCHABLE_BUILDS = True  # compile_launchable in blackwell_fwd and stage4_bwd_kernel.blackwell

    def import_forward(self):
        from stage3_fwd_kernel import blackwell_fwd

        return blackwell_fwd

    def import_backward(self):
        from stage4_bwd_kernel import blackwell

        return blackwell

    def _call_forward(self, mod, q, k, v, softmax_scale, causal, **variants):
        kw = dict(variants)
        # a left window makes the causal tiles (nearly) equal: nothing for LPT to order
        lpt = causal and "window_size" not in variants
        sched = causal_forward_scheduler(self.arch.key, lpt, k.shape[1], q.shape[-1], v.shape[-1], q.shape[2],
                                         k.shape[2], _l2_bytes(q.device))
        sched = lpt_for_grid(sched, q.shape[1], q.shape[2], q.shape[0])
        if sched is not None:
            kw["scheduler"] = sched
        elif self._persistent(mod, q, v, causal, variants):
            kw["persistent"] = True
        return mod.attention_forward(q, k, v, softmax_scale=softmax_scale, causal=causal, **kw)

    @staticmethod
    def _persistent(mod, q, v, causal: bool, variants: dict) -> bool:
        """One CTA per SM walking the tiles (blackwell_persistent.py) where the stage module's
        `default_persistent` says so: dense calls with neither causal nor a window, where the build exists."""
        return mod.default_persistent(str(q.dtype), q.shape[-1], v.shape[-1], causal,
                                      window_size=variants.get("window_size", (None, None)),
                                      softcap=variants.get("softcap", 0.0), learnable_sink="learnable_sink" in variants)

    def _call_varlen_forward(self, mod, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
                             softmax_scale, causal, **variants):
        return mod.attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, seqused_k=seqused_k,
                                            softmax_scale=softmax_scale, causal=causal, **variants)

    def paged_in_place(self, head_dim: int, head_dim_v: int, page_size: int, query_rows=None,
                       head_rows=None) -> bool:
        """Pages of whole key blocks (a multiple of 128 keys: one TMA box a block at its page) and pages
        of 16 / 32 / 64 keys (one box a page; not at (192, 128)), by
        stage3_fwd_kernel.blackwell_config.pages_in_place; other sizes are copied. Pages of 16 follow
        the Hopper rule measured on an H200 (SMALL_PAGE_COPY_HEAD_ROWS): the same TMA boxes a block.
        Compiled only."""
        from stage3_fwd_kernel.blackwell_config import TILE_N, pages_in_place

        if not pages_in_place(page_size, TILE_N, (head_dim, head_dim_v)):
            return False
        small = page_size < TILE_N and TILE_N // page_size >= SMALL_PAGE_BOXES
        return not (small and head_rows is not None and head_rows >= SMALL_PAGE_COPY_HEAD_ROWS)


BACKEND_TYPES = {"sm_90": HopperBackend, "sm_100": BlackwellBackend}


@functools.lru_cache(maxsize=16)
def _l2_bytes(device) -> Optional[int]:
    """The L2 size of a CUDA device (None when it cannot be asked: CPU tensors in tests)."""
    import torch

    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return int(torch.cuda.get_device_properties(device).L2_cache_size)


def make_backend(arch: ArchInfo) -> Backend:
    return BACKEND_TYPES[arch.key](arch)


def _install_disk_cache():
    """Put fa4's disk cache behind the stages' compile cache (once; the stages never import fa4)."""
    from stage3_fwd_kernel import compile_cache

    from . import _cache

    if compile_cache.get_store() is not _cache.STORE:
        compile_cache.set_store(_cache.STORE)


def variant_kwargs(window=(None, None), softcap: float = 0.0, learnable_sink=None) -> dict:
    """The kernel keyword arguments of the variants that are not at their defaults (so a plain call
    reaches the kernel module exactly as before the variants existed)."""
    kw = {}
    if tuple(window) != (None, None):
        kw["window_size"] = tuple(window)
    if softcap != 0.0:
        kw["softcap"] = softcap
    if learnable_sink is not None:
        kw["learnable_sink"] = learnable_sink
    return kw


def sink_grad(out, dout, lse, sink, dlse=None, d=None):
    """The gradient of a learnable sink (one logit per query head), with torch ops.

    The sink joins row i's softmax denominator: lse_i = log(exp(sink_h) + sum_j exp(s_ij)), and
    out_i = sum_j exp(s_ij - lse_i) v_j. So d out_i / d sink_h = -exp(sink_h - lse_i) out_i and
    d lse_i / d sink_h = exp(sink_h - lse_i) =: p_i (the sink's own probability), giving

        dsink_h = sum over batch and rows i of p_i (dlse_i - D_i),   D_i = rowsum(dout_i * out_i)

    (dlse = 0 when lse gets no gradient). `d`: the backward kernel's D rows, in lse's layout, which
    already hold D_i - dlse_i (its preprocess forms them) -- pass them to skip the pass over out and
    dout, and then no dlse (it would be subtracted twice: a ValueError). `lse` is the
    forward's (sink included). Dense: out/dout (B, Sq, H, Dv), lse/dlse (B, H, Sq); varlen:
    (Tq, H, Dv) and (H, Tq). A row with lse = -inf contributes 0. Computed in fp32 (fp64 for
    fp64 inputs); returned in the sink's dtype."""
    import torch

    if d is not None and dlse is not None:
        raise ValueError("dlse: not with d, whose rows already hold D - dlse")
    acc = torch.promote_types(lse.dtype, torch.float32)
    if d is None:
        d = (dout.to(acc) * out).sum(-1)                                   # (B, Sq, H) / (Tq, H)
        d = d.permute(0, 2, 1) if lse.dim() == 3 else d.transpose(0, 1)  # -> lse's layout
    d = d.to(acc)
    if dlse is not None:
        d = d - dlse.to(acc)
    s = sink.to(acc).view(-1, 1)                                       # (H, 1): broadcasts over rows
    empty = lse == float("-inf")
    p = torch.where(empty, 0.0, torch.exp(s - lse.to(acc)))
    dims = (0, 2) if lse.dim() == 3 else (1,)
    return (-torch.where(empty, 0.0, p * d)).sum(dims).to(sink.dtype)  # an empty row's dlse may be inf


_BACKENDS: dict = {}
_BACKEND_OF_DEVICE: dict = {}  # CUDA device index -> its Backend


def backend_for(device) -> Backend:
    """The Backend serving `device` (a torch.device). CPU and unlisted GPUs raise
    UnsupportedDeviceError (a ValueError) naming what is supported."""
    import torch

    if device.type != "cuda":
        raise UnsupportedDeviceError(
            f"q: fa4 runs on CUDA GPUs only, got {device.type} tensors. Supported: {supported_devices_text()}.")
    index = device.index if device.index is not None else torch.cuda.current_device()
    backend = _BACKEND_OF_DEVICE.get(index)
    if backend is None:  # first call on this GPU: asking the driver costs ~10 us, so once per device
        arch = arch_for_capability(torch.cuda.get_device_capability(index))
        if arch.key not in _BACKENDS:
            _BACKENDS[arch.key] = make_backend(arch)
        backend = _BACKEND_OF_DEVICE[index] = _BACKENDS[arch.key]
    return backend
