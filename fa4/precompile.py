"""`python -m fa4 precompile`: build the kernels of the common configurations ahead of time.

On a GPU (sm_90 / sm_100) every configuration is built the way a model builds it -- by calling
fa4 on tiny tensors -- so the compiled kernels land in this process's memory cache *and* in the
on-disk cache (fa4/_cache.py), and the next process loads them in milliseconds instead of
compiling for seconds. Each line says whether the kernel was compiled or loaded from disk.

Without a GPU it compiles the same kernels for sm_90a (or --arch sm_100a) with fake tensors and
prints the time and resource report of each (registers, shared memory, spills). Modules with a
`compile_launchable` (the Hopper and the Blackwell forward and backward) build exactly what their
GPU path launches -- TVM-FFI functions under the GPU path's cache keys -- so these land in the disk
cache too: a CPU build machine can fill a cache that GPU machines then load, provided both run the
same CuTe-DSL, apache-tvm-ffi and Python minor version (the cache fingerprint). The Blackwell
kernels are compiled only: no Blackwell GPU has loaded them.

Causal Hopper forwards with >= 4096 keys launch stage 5's LPT tile order, whose section size (a
compile-time constant) depends on the head counts and the key length. `--heads HQ[/HKV]` adds
those kernels for every length up to `--max-seqlen` (one kernel per section size, usually 2-6).
On sm_100 the section size follows the device's own L2: on a Blackwell GPU precompile reads it, and
on a CPU `--arch sm_100a --l2-bytes N` takes it (the device's `L2_cache_size`); without either, those
kernels compile on first use.

`--shapes` / `--model-config` build exactly what a model's calls launch instead (head dims, GQA,
causal, sliding window, softcap, sink, LPT range; `derive_builds`), through compile_launchable on
either path, under the cache keys the launches compute.
"""
from __future__ import annotations

import functools
import sys
import time
from dataclasses import dataclass, replace
from typing import Iterable, Optional

DTYPES = ("bf16", "fp16")
# What most models use: bf16, head dim 64 or 128, causal and not. --all builds every
# supported (dtype, head dims, causal) combination of the arch.
COMMON = [("bf16", 64, 64, False), ("bf16", 64, 64, True), ("bf16", 128, 128, False), ("bf16", 128, 128, True)]


def configs(all_configs=False, dtypes=None, head_dims=None, causal=None, arch="sm_90") -> list[tuple]:
    """(dtype, d, dv, causal) tuples. head_dims: iterable of ints or (d, dv) pairs."""
    from ._dispatch import ARCHS

    table = ARCHS[arch].head_dims
    if not (all_configs or dtypes or head_dims or causal is not None):
        return [c for c in COMMON if (c[1], c[2]) in table]
    dts = list(dtypes or (DTYPES if all_configs else ("bf16",)))
    if head_dims:
        from ._layouts import native_pair

        hds = [(h, h) if isinstance(h, int) else tuple(h) for h in head_dims]
        bad = [h for h in hds if native_pair(ARCHS[arch], *h) is None]
        if bad:
            raise ValueError(f"head_dims: {bad} not supported on {arch}; native: {list(table)} (a pair of multiples "
                             "of 8 runs on a native pair at least as large)")
        hds = list(dict.fromkeys(native_pair(ARCHS[arch], *h) for h in hds))  # the kernels that serve them
    else:
        hds = list(table) if all_configs else [(64, 64), (128, 128)]
    cs = [False, True] if causal is None else [bool(causal)]
    return [(dt, d, dv, c) for dt in dts for d, dv in hds for c in cs]


DEFAULT_MAX_SEQLEN = 131072


def parse_heads(text: str) -> list[tuple[int, int]]:
    """'32/8,16' -> [(32, 8), (16, 16)]: query heads / KV heads (MHA when the KV count is left out)."""
    import argparse

    pairs = []
    for item in (x.strip() for x in str(text).split(",")):
        try:
            hq, hkv = (int(y) for y in item.split("/")) if "/" in item else (int(item), int(item))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected HQ or HQ/HKV (e.g. 32/8,16), got {item!r}") from None
        if hq < 1 or hkv < 1 or hq % hkv:
            raise argparse.ArgumentTypeError(f"{item!r}: heads must be >= 1 and HQ a multiple of HKV")
        pairs.append((hq, hkv))
    return pairs


def lpt_ranges(arch_key: str, head_dim: int, head_dim_v: int, heads_q: int, heads_kv: int, max_seqlen: int,
               l2_bytes: Optional[int] = None, **variant) -> list:
    """`lpt_forward_schedulers`' (first, last, scheduler) ranges, and where they end before max_seqlen
    (stage 3 walks d = 96's tile from 8192 keys in the grid's order) one more, (first, max_seqlen, None),
    for the grid-order build of the lengths past them. variant: softcap / sink, as the dispatch takes them;
    l2_bytes: the sm_100 device's L2 (`--l2-bytes`)."""
    from ._dispatch import lpt_forward_schedulers

    ranges = lpt_forward_schedulers(arch_key, head_dim, head_dim_v, heads_q, heads_kv, max_seqlen, l2_bytes=l2_bytes,
                                    **variant)
    if ranges and ranges[-1][1] < max_seqlen:
        ranges.append((ranges[-1][1] + 1, max_seqlen, None))
    return ranges


def lpt_builds(cfgs: Iterable[tuple], heads: Iterable[tuple[int, int]], max_seqlen: int, arch_key: str,
               l2_bytes: Optional[int] = None) -> list[dict]:
    """The LPT-ordered forward kernels that causal calls of these head counts with up to max_seqlen
    keys launch (fa4._dispatch.causal_forward_scheduler), one per distinct (dtype, head dims,
    scheduler): head counts that share a section size share the kernel; and past the LPT ranges the
    grid-order build (scheduler None, `lpt_ranges`)."""
    builds, seen = [], set()
    for dt, d, dv, causal in cfgs:
        if not causal:
            continue
        for hq, hkv in heads:
            for first, last, sched in lpt_ranges(arch_key, d, dv, hq, hkv, max_seqlen, l2_bytes):
                if (dt, d, dv, sched) not in seen:
                    seen.add((dt, d, dv, sched))
                    builds.append({"dtype": dt, "head_dim": d, "head_dim_v": dv, "heads": f"{hq}/{hkv}",
                                   "seqlen_k": (first, last), "scheduler": sched})
    return builds


# why an arch without AHEAD_LONG_BUILDS skips the LPT kernels ({} = the forward module)
_NO_AHEAD_LPT = ("{}'s LPT sections are sized by the device's L2, so long causal calls compile them on first use "
                 "(pass --l2-bytes with the device's L2 size to build them here)")


def _no_ahead_lpt_note(arch_key: str) -> str:
    from ._dispatch import ARCHS, LPT_MIN_SEQLEN_K

    module = ARCHS[arch_key].forward_module
    return f"note: causal calls with >= {LPT_MIN_SEQLEN_K} keys: " + _NO_AHEAD_LPT.format(module)


def _lpt_hint(cfgs, arch_key: str, ahead: bool = True) -> Optional[str]:
    """A line for runs without --heads whose causal configs would also launch LPT kernels (ahead:
    whether precompile can build them, `Backend.AHEAD_LONG_BUILDS`)."""
    from ._dispatch import LPT_MIN_SEQLEN_K, causal_forward_scheduler

    lpt_here = causal_forward_scheduler(arch_key, True, LPT_MIN_SEQLEN_K, 128, 128, 1, 1) is not None
    if not any(c[3] for c in cfgs) or not lpt_here:
        return None
    if not ahead:
        return _no_ahead_lpt_note(arch_key)
    return (f"note: causal calls with >= {LPT_MIN_SEQLEN_K} keys launch LPT-ordered kernels that depend on the head "
            "counts and the length; add --heads HQ[/HKV] (and --max-seqlen) to build those too")


def _lpt_task(mod, build: dict) -> tuple:
    """(config, what to build, label detail, extra row fields) of one LPT kernel (or, scheduler None,
    the grid-order build past the LPT ranges), for either path. `mod` is the Hopper forward (the only
    one with scheduled builds); the key count picks the tile and persistent CTAs or not, so the
    range's first length goes in."""
    first, last = build["seqlen_k"]
    sched = build["scheduler"]
    sections = None if sched is None else sched.heads_per_section
    compile_it = functools.partial(mod.compile_launchable, dtype=build["dtype"], head_dim=build["head_dim"],
                                   head_dim_v=build["head_dim_v"], causal=True, scheduler=sched, seqlen_k=first)
    order = "grid order" if sched is None else f"{sections} heads/section"
    return ((build["dtype"], build["head_dim"], build["head_dim_v"], True), compile_it,
            f"{order}, keys {first}-{last}, heads {build['heads']}: ",
            {"heads": build["heads"], "seqlen_k": [first, last], "heads_per_section": sections})


class Progress:
    """A plain-text progress bar, one line per finished item (readable in CI logs too)."""

    def __init__(self, total: int, out=None, width: int = 20):
        self.total, self.done, self.width, self.out = total, 0, width, out or sys.stdout
        self.t0 = time.perf_counter()

    def step(self, label: str, detail: str):
        self.done += 1
        filled = round(self.width * self.done / max(self.total, 1))
        bar = "#" * filled + "-" * (self.width - filled)
        n = len(str(self.total))
        print(f"[{bar}] {self.done:>{n}}/{self.total} {label:<34} {detail}", file=self.out, flush=True)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0


def _label(kind, dt, d, dv, c):
    return f"{kind} {dt} d={d}" + (f"/{dv}" if dv != d else "") + (" causal" if c else "")


# ---------------------------------------------------------------------------------------------
# what a model will use: --shapes / --model-config -> workloads -> the exact builds
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    """One kind of attention call a model makes: its dtype, head dims and counts, causal, the longest
    key length (None: short calls only), and the variant at fa4's level (window_size as fa4 takes it,
    None = no window; softcap 0 = none; sink: a learnable_sink is passed). `min_seqlen` is the
    shortest key length that takes this form (a transformers sliding layer runs unwindowed calls up
    to its window and windowed ones beyond it)."""

    dtype: str = "bf16"
    head_dim: int = 128
    head_dim_v: int = 128
    heads_q: int = 1
    heads_kv: int = 1
    causal: bool = True
    max_seqlen: Optional[int] = None
    window: Optional[tuple] = None
    softcap: float = 0.0
    sink: bool = False
    min_seqlen: int = 1
    decode: bool = False  # also calls with <= 64 query rows: flash_attn_func decode and flash_attn_with_kvcache

    def variant(self) -> dict:
        """The variant keywords of compile_launchable (forward); the backward takes all but the sink."""
        return dict(window_size=self.window or (None, None), softcap=self.softcap, learnable_sink=self.sink)


def _spec_int(key: str, value: str, minimum: int = 1) -> int:
    try:
        n = int(value)
    except ValueError:
        n = minimum - 1
    if n < minimum:
        raise ValueError(f"{key}={value!r}: expected an integer >= {minimum}")
    return n


def parse_shape(text: str) -> Workload:
    """'d=128,heads=32/8,causal,seqlen=4096' -> Workload. Items: d=D or d=D/DV; heads=HQ[/HKV];
    causal | noncausal; seqlen=MAX_KEYS; dtype=bf16|fp16; window=LEFT[/RIGHT] (fa4's window_size;
    a causal window takes LEFT only); softcap=X; sink."""
    fields: dict = {}
    for item in (x.strip() for x in str(text).split(",")):
        key, _, value = item.partition("=")
        if key in ("causal", "noncausal") and not value:
            fields["causal"] = key == "causal"
        elif key in ("sink", "decode") and not value:
            fields[key] = True
        elif key in ("d", "head_dim"):
            d, _, dv = value.partition("/")
            fields["head_dim"] = _spec_int(key, d)
            fields["head_dim_v"] = _spec_int(key, dv) if dv else fields["head_dim"]
        elif key == "heads":
            ((hq, hkv),) = parse_heads(value)
            fields.update(heads_q=hq, heads_kv=hkv)
        elif key in ("seqlen", "max_seqlen"):
            fields["max_seqlen"] = _spec_int(key, value)
        elif key == "dtype" and value in DTYPES:
            fields["dtype"] = value
        elif key == "window":
            left, _, right = value.partition("/")
            fields["window"] = (_spec_int(key, left, 0), _spec_int(key, right, 0) if right else None)
        elif key == "softcap":
            fields["softcap"] = float(value)
        else:
            raise ValueError(f"{item!r}: expected d=D[/DV], heads=HQ[/HKV], causal, noncausal, seqlen=N, "
                             f"dtype=bf16|fp16, window=LEFT[/RIGHT], softcap=X, sink or decode")
    if "head_dim" not in fields:
        raise ValueError(f"{text!r}: needs d=HEAD_DIM")
    w = fields.get("window")
    if w is not None and fields.get("causal", True):
        fields["window"] = (w[0], 0)  # fa4: causal is right = 0
    return Workload(**fields)


def parse_shapes(text: str) -> list[Workload]:
    """argparse type of --shapes: workloads separated by ';' (or give --shapes several times)."""
    import argparse

    try:
        return [parse_shape(s) for s in str(text).split(";") if s.strip()]
    except (ValueError, argparse.ArgumentTypeError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


ENCODER_MODELS = ("bert", "roberta", "xlm-roberta", "distilbert", "electra", "deberta", "deberta-v2", "modernbert")
SINK_MODELS = ("gpt_oss",)  # attention sinks (s_aux): a learnable_sink per layer


def _config_dtype(cfg: dict) -> str:
    name = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    return "fp16" if name.endswith("float16") and "bfloat" not in name else "bf16"


def workloads_from_config(cfg: dict, *, dtype: Optional[str] = None, max_seqlen: Optional[int] = None) -> list:
    """A Hugging Face config (dict of config.json; a multimodal one's text_config) -> the Workloads its
    attention layers run through fa4.integrations.transformers: head_dim (or hidden_size / heads),
    num_attention_heads / num_key_value_heads (GQA), causal (decoders), attn_logit_softcapping, gpt-oss's
    sinks, and sliding_window per layer (layer_types, else every layer; Gemma's alternate). A sliding
    layer with window w runs unwindowed calls up to w keys and window_size (w - 1, 0) beyond (as
    transformers' FlashAttention path). max_seqlen: the longest key length (default the config's
    max_position_embeddings)."""
    cfg = cfg.get("text_config") or cfg
    hq = int(cfg["num_attention_heads"])
    hkv = int(cfg.get("num_key_value_heads") or hq)
    if hq < 1 or hkv < 1 or hq % hkv:
        raise ValueError(f"num_attention_heads ({hq}) must be a positive multiple of num_key_value_heads ({hkv})")
    d = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // hq)
    model = str(cfg.get("model_type", ""))
    causal = model not in ENCODER_MODELS and cfg.get("is_causal", True) is not False
    longest = max_seqlen or cfg.get("max_position_embeddings") or DEFAULT_MAX_SEQLEN
    base = Workload(dtype=dtype or _config_dtype(cfg), head_dim=d, head_dim_v=d, heads_q=hq, heads_kv=hkv,
                    causal=causal, max_seqlen=int(longest), softcap=float(cfg.get("attn_logit_softcapping") or 0.0),
                    sink=model in SINK_MODELS)
    window = cfg.get("sliding_window")
    if cfg.get("use_sliding_window") is False:
        window = None
    kinds = set(cfg.get("layer_types") or ())
    if not kinds:
        kinds = {"full_attention"} if not window else (
            {"sliding_attention", "full_attention"} if model.startswith("gemma") else {"sliding_attention"})
    out = []
    if "full_attention" in kinds or not window:
        out.append(base)
    if "sliding_attention" in kinds and window:
        w = int(window)
        short = replace(base, max_seqlen=min(base.max_seqlen, w))
        if short not in out:
            out.append(short)
        if base.max_seqlen > w:
            right = 0 if causal else w - 1
            out.append(replace(base, window=(w - 1, right), min_seqlen=w + 1))
    return out


def load_model_config(path: str) -> dict:
    import json

    with open(path) as f:
        cfg = json.load(f)
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: expected a JSON object (a Hugging Face config.json)")
    return cfg


def on_native_head_dims(w: Workload, arch_key: str) -> Workload:
    """The workload as the kernels run it: head dims without a kernel of their own run zero-padded on
    the native pair fa4._layouts.native_pair picks (ValueError naming head_dim when none covers them)."""
    from ._dispatch import ARCHS
    from ._layouts import native_pair

    pair = native_pair(ARCHS[arch_key], w.head_dim, w.head_dim_v)
    if pair is None:
        raise ValueError(f"head_dim: ({w.head_dim}, {w.head_dim_v}) exceeds every kernel on {arch_key}")
    return replace(w, head_dim=pair[0], head_dim_v=pair[1])


PAGE_GATHER = Workload(dtype="bf16", head_dim=0, head_dim_v=0, causal=False)  # one build for every call


def add_decode(add, w: Workload, longest: int):
    """The builds of short-query calls (fa4._dispatch.short_query_tile): the dense forward (decode
    through flash_attn_func; short and long key counts differ where persistence does), and what
    flash_attn_with_kvcache launches -- its key segments and their merges (`add_kvcache_segments`), the
    split launch (one token, its window a key range; causal or windowed tokens with the GQA group packed
    as rows where it divides the tile, and not packed), and the page gather that copies a paged cache
    fa4 does not read in place (one build for every dtype and shape). (A paged cache's split launch is a
    build per page size, and one over cache_batch_idx rows a build of its own: neither is derived here.)"""
    from ._dispatch import LPT_MIN_SEQLEN_K, SHORT_QUERY_TILE_M

    add("fwd short", w, tile_m=SHORT_QUERY_TILE_M)
    if longest >= LPT_MIN_SEQLEN_K:
        add("fwd short", w, tile_m=SHORT_QUERY_TILE_M, seqlen_k_first=longest)
    add_kvcache_segments(add, w, tile_m=SHORT_QUERY_TILE_M)
    add("kvcache split", replace(w, causal=False, window=None, sink=False), tile_m=SHORT_QUERY_TILE_M,
        rows_per_query=1)
    g = w.heads_q // w.heads_kv
    packed = g if g > 1 and SHORT_QUERY_TILE_M % g == 0 else 1
    if w.causal or w.window is not None:  # rows masked by token: causal tokens, a window (pages, tokens)
        for rows in sorted({1, packed}):
            add("kvcache split", replace(w, sink=False), tile_m=SHORT_QUERY_TILE_M, rows_per_query=rows)
    add("page gather", PAGE_GATHER)


def add_kvcache_segments(add, w: Workload, **tile):
    """flash_attn_with_kvcache's key segments: the varlen forward with seqused_k (causal as asked, and
    not causal: one query token drops it, and its window too: a key range; the sink is added by torch),
    and the merges of split-KV parts (rows as the parts hold them, and packed rows of several tokens
    unpacked by the merge). On sm_100, which has no split launch, this is all decoding launches beyond
    the dense forward (pages read in place are a build per page size: not derived)."""
    for causal in {w.causal, False}:
        add("kvcache", replace(w, causal=causal, sink=False), **tile)
    if w.window is not None:  # one token's window is a key range: the free mask's build (traced calls)
        add("kvcache", replace(w, causal=False, window=None, sink=False), **tile)
    add("combine", replace(w, causal=False, window=None, softcap=0.0, sink=False))


def derive_builds(workloads: Iterable[Workload], arch_key: str = "sm_90", *, backward: bool = True,
                  varlen: bool = False, l2_bytes: Optional[int] = None) -> list[dict]:
    """The kernels these workloads launch, each once: per (dtype, head dims, causal, variant) the
    forward of short calls (compile_launchable; non-causal plain ones add the long calls' split-tail
    build), the forward of long calls where the key count changes the build (past the LPT ranges,
    d = 96's 192 x 144 tile from 8192 keys), the LPT-ordered forwards of causal calls with >=
    LPT_MIN_SEQLEN_K keys (one per section size, as `lpt_builds`; on sm_100 only given the device's
    L2 size, l2_bytes, see `arch_notes`),
    the backward (preprocess, main, postprocess) unless backward=False, and the varlen forward /
    backward when varlen=True.
    Each build is a dict: kind, dtype, head_dim, head_dim_v, causal, variant (compile_launchable
    keywords), seqlen_k, and for LPT builds scheduler / heads."""
    from ._dispatch import ARCHS, LPT_MIN_SEQLEN_K, has_backward

    builds, seen = [], set()

    def add(kind, w, **extra):
        variant = w.variant() if kind.startswith("fwd") or kind in ("varlen", "kvcache", "combine") else \
            dict(window_size=w.window or (None, None), softcap=w.softcap)
        b = dict(kind=kind, dtype=w.dtype, head_dim=w.head_dim, head_dim_v=w.head_dim_v, causal=w.causal,
                 variant=variant, seqlen_k=None, **extra)
        # one kernel per signature: the key length only matters as >= LPT_MIN_SEQLEN_K or not (the
        # persistent switch), and every long build's first length is >= it (d = 96's: >= 8192, its tile's switch)
        sig = repr({k: v for k, v in b.items() if k not in ("heads", "seqlen_range", "seqlen_k_first")})
        if sig not in seen:
            seen.add(sig)
            builds.append(b)

    for w in workloads:
        w = on_native_head_dims(w, arch_key)
        longest = w.max_seqlen or 0
        left_window = w.window is not None  # a workload's window always has a left edge (spec / config)
        # some calls are short; a left window keeps the short calls' build at every length (stage3
        # default_persistent), so it is the only windowed forward
        if w.min_seqlen < LPT_MIN_SEQLEN_K or not w.causal or left_window:
            add("fwd", w)
        # sm_100's long causal calls take LPT kernels sized by the device's L2: built here given its size,
        # else on first use (`arch_notes`); no other build of its forward depends on the key count
        lpt = w.causal and w.window is None and (arch_key == "sm_90" or l2_bytes is not None)
        first_len = max(w.min_seqlen, LPT_MIN_SEQLEN_K)
        if lpt and longest >= LPT_MIN_SEQLEN_K:
            for first, last, sched in lpt_ranges(arch_key, w.head_dim, w.head_dim_v, w.heads_q, w.heads_kv, longest,
                                                 l2_bytes, softcap=bool(w.softcap), sink=bool(w.sink)):
                if last < first_len:
                    continue
                if sched is None:   # past the LPT ranges: the grid-order build
                    add("fwd long", w, seqlen_k_first=max(first, first_len))
                else:
                    add("fwd lpt", w, scheduler=sched, seqlen_k_first=max(first, first_len),
                        heads=f"{w.heads_q}/{w.heads_kv}", seqlen_range=(max(first, first_len), last))
        with_bwd = backward and has_backward(ARCHS[arch_key], w.head_dim, w.head_dim_v)
        if with_bwd:
            add("bwd", w)
        if varlen:
            add("varlen", w)
            if with_bwd:
                add("bwd varlen", w)
            if arch_key == "sm_90":  # a paged cache that varlen calls copy (fa4._paged)
                add("page gather", PAGE_GATHER)
        if w.decode and arch_key == "sm_90":
            add_decode(add, w, longest)
        elif w.decode:  # no split launch: key segments of the varlen forward, merged
            add_kvcache_segments(add, w)
    for b in builds:
        b["seqlen_k"] = b.pop("seqlen_k_first", None)
    return builds

# ---------------------------------------------------------------------------------------------
# CPU: compile-only through the stage modules
# ---------------------------------------------------------------------------------------------
def _ensure_arch(arch: str):
    """--arch is an explicit choice: it wins over any value not yet read by cutlass."""
    from stage2_emulated_exp import cute_arch

    cur = cute_arch.retarget(arch, override_user=True)
    if cur not in (None, arch):
        raise RuntimeError(f"--arch {arch}: cutlass is already imported for {cur} in this process; "
                           "run precompile in a fresh process")


def _resources(rep: dict) -> str:
    return (f"regs={rep.get('registers')} smem={rep.get('smem_bytes')} "
            f"spills={rep.get('spill_stores')}/{rep.get('spill_loads')}")


def _state(before: dict, after: dict, launchable: bool, row: Optional[dict] = None) -> str:
    """What a build did, from the cache statistics around it; a store that failed also marks `row`
    as an error (the exit status says so)."""
    if after["store_errors"] > before["store_errors"]:
        if row is not None:
            row["error"] = "the disk cache could not store this build's kernels"
        return "NOT all written: the disk cache could not store them (see the warning)"
    if after["stores"] > before["stores"]:
        return "written to disk"
    if after["disk_hits"] > before["disk_hits"]:
        return "already on disk"
    if not launchable:
        return "compile-only, not runnable"
    if after["misses"] == before["misses"] and after["memory_hits"] > before["memory_hits"]:
        return "same kernel as an earlier build"
    return "not written (cache off?)"


def _builder(mod, launchable: bool, varlen: bool = False):
    """build(dtype, d, dv, causal) -> list of Compiled: the module's launchable builds (the GPU
    path's kernels and cache keys) where the arch has them (`Backend.LAUNCHABLE_BUILDS`), else its
    compile-only build (not runnable); None for varlen without launchable builds."""
    if launchable:
        return lambda dt, d, dv, c: mod.compile_launchable(dtype=dt, head_dim=d, head_dim_v=dv, causal=c,
                                                           varlen=varlen)
    if varlen:
        return None
    return lambda dt, d, dv, c: [mod.compile_only(dtype=dt, head_dim=d, head_dim_v=dv, causal=c)]


def compile_only(cfgs: Iterable[tuple], *, arch: str = "sm_90a", backward=True, varlen=True, out=None,
                 heads: Optional[list] = None, max_seqlen: int = DEFAULT_MAX_SEQLEN,
                 l2_bytes: Optional[int] = None) -> list[dict]:
    from . import _cache
    from ._dispatch import ARCHS, _install_disk_cache, has_backward, make_backend

    out = out or sys.stdout
    info = next(a for a in ARCHS.values() if a.cute_arch == arch)
    _ensure_arch(arch)
    backend = make_backend(info)
    launchable = backend.LAUNCHABLE_BUILDS
    fwd_name = info.forward_module
    fwd_mod = backend.import_forward()
    roles = [("fwd", fwd_name, fwd_mod, False)]
    if backward:
        roles.append(("bwd", info.backward_module, backend.import_backward(), False))
    if varlen:
        roles.append(("varlen", fwd_name, fwd_mod, True))
    jobs = []
    for kind, name, mod, vl in roles:
        build = _builder(mod, launchable, varlen=vl)
        if build is not None:
            jobs.append((kind, name, build, launchable))
    cfgs = list(cfgs)
    # (kind, module, config, what to build, launchable, label detail, extra row fields)
    tasks = [(kind, name, cfg, functools.partial(build, *cfg), launchable, "", {})
             for kind, name, build, launchable in jobs for cfg in cfgs
             if kind != "bwd" or has_backward(info, cfg[1], cfg[2])]
    ahead = backend.AHEAD_LONG_BUILDS or l2_bytes is not None  # sm_100: given the device's L2 size
    if heads and ahead:
        for b in lpt_builds(cfgs, heads, max_seqlen, info.key, l2_bytes):
            cfg, compile_it, prefix, extra = _lpt_task(fwd_mod, b)
            tasks.append(("fwd lpt", fwd_name, cfg, compile_it, True, prefix, extra))
    elif heads:
        print(f"--heads: {_NO_AHEAD_LPT.format(fwd_name)}; LPT kernels skipped", file=out)
    elif hint := _lpt_hint(cfgs, info.key, ahead):
        print(hint, file=out)
    persist = _cache.enabled() and any(t[4] for t in tasks)
    if persist:
        _install_disk_cache()  # launchable builds carry the GPU path's keys: they go to the disk cache
    prog = Progress(len(tasks), out)
    where = f"disk cache: {_cache.cache_dir(arch)}" if persist else "nothing written to the disk cache"
    print(f"no GPU: compiling for {arch} with fake tensors, {len(cfgs)} configs x "
          f"{', '.join(f'{k} ({m})' for k, m, *_ in jobs)}"
          + (f" + {len(tasks) - len(jobs) * len(cfgs)} LPT forward kernel(s)" if heads else "")
          + f"; {where}", file=out, flush=True)
    results = []
    for kind, name, (dt, d, dv, c), build, launchable, prefix, extra in tasks:
        t0 = time.perf_counter()
        before = _cache.stats()
        row = {"kind": kind, "module": name, "dtype": dt, "head_dim": d, "head_dim_v": dv, "causal": c,
               "launchable": launchable, **extra}
        try:
            comps = build()
            after = _cache.stats()
            row.update(seconds=time.perf_counter() - t0, kernels=len(comps),
                       stored=after["stores"] - before["stores"],
                       reports=[{k: v for k, v in comp.report.items() if k != "ptxas_log"} for comp in comps])
            state = _state(before, after, launchable, row)
            main = max(comps, key=lambda comp: comp.report.get("registers") or 0)
            detail = f"{prefix}{len(comps)} kernel(s) in {row['seconds']:.1f} s, {state}  {_resources(main.report)}"
        except Exception as exc:  # report and continue: the point is the whole table
            row.update(seconds=time.perf_counter() - t0, error=f"{type(exc).__name__}: {exc}"[:300])
            detail = f"{prefix}FAILED {row['error'][:100]}"
        results.append(row)
        prog.step(_label(kind, dt, d, dv, c), detail)
    st = _cache.stats()
    print(f"done: {len(results)} builds in {prog.elapsed():.1f} s, {st['stores']} kernels written to "
          f"{_cache.cache_dir(arch) if persist else 'no disk cache'}", file=out)
    if persist:
        print("a GPU machine loads them when it runs the same CuTe-DSL, apache-tvm-ffi and Python minor version "
              "and these kernel sources (the cache fingerprint; FA4_CACHE_DIR points it at a copied cache)", file=out)
    return results


def arch_notes(workloads: Iterable[Workload], arch_key: str, l2_bytes: Optional[int] = None) -> list[str]:
    """Lines for what `derive_builds` leaves out of these workloads on an arch without
    `Backend.AHEAD_LONG_BUILDS` (sm_100) when the device's L2 size is not given: the LPT kernels of
    long causal calls. Empty elsewhere."""
    from ._dispatch import BACKEND_TYPES, LPT_MIN_SEQLEN_K

    if BACKEND_TYPES[arch_key].AHEAD_LONG_BUILDS or l2_bytes is not None:
        return []
    workloads = list(workloads)
    notes = []
    if any(w.causal and w.window is None and (w.max_seqlen or 0) >= LPT_MIN_SEQLEN_K for w in workloads):
        notes.append(_no_ahead_lpt_note(arch_key))
    return notes


# ---------------------------------------------------------------------------------------------
# GPU: build through the public API, which fills the memory and disk caches
# ---------------------------------------------------------------------------------------------
def on_gpu(cfgs: Iterable[tuple], *, backward=True, varlen=True, out=None, heads: Optional[list] = None,
           max_seqlen: int = DEFAULT_MAX_SEQLEN) -> list[dict]:
    import torch

    from . import _cache
    from ._api import flash_attn_func, flash_attn_varlen_func
    from ._dispatch import _l2_bytes, backend_for, has_backward

    out = out or sys.stdout
    dev = torch.device("cuda", torch.cuda.current_device())
    backend = backend_for(dev)
    l2 = None if backend.AHEAD_LONG_BUILDS else _l2_bytes(dev)  # sm_100's LPT sections: this device's L2
    arch = backend.arch
    has_bwd, has_varlen = backward, varlen
    cfgs = [c for c in cfgs if (c[1], c[2]) in arch.head_dims]
    kinds = ["fwd"] + (["bwd"] if has_bwd else []) + (["varlen"] if has_varlen else [])
    fwd_mod = backend.forward_module()  # imported with the disk cache installed
    scheduled = backend.AHEAD_LONG_BUILDS or l2 is not None  # LPT-ordered kernels can be built ahead of time
    lpt = lpt_builds(cfgs, heads, max_seqlen, arch.key, l2) if heads and scheduled else []
    print(f"precompile on {torch.cuda.get_device_name(dev)} ({arch.key}): {len(cfgs)} configs x {', '.join(kinds)}"
          + (f" + {len(lpt)} LPT forward kernel(s)" if heads else "")
          + f"; disk cache: {_cache.cache_dir() if _cache.enabled() else 'disabled (FA4_CACHE=0)'}",
          file=out, flush=True)
    if heads and not scheduled:
        print(f"--heads: {_NO_AHEAD_LPT.format(fwd_mod.__name__)}; LPT kernels skipped", file=out)
    elif not heads and (hint := _lpt_hint(cfgs, arch.key, scheduled)):
        print(hint, file=out)
    tdt = {"bf16": torch.bfloat16, "fp16": torch.float16}
    tasks = []  # (kind, config, call, label detail, extra row fields)
    for dt, d, dv, c in cfgs:
        # tiny tensors: compiles are keyed by (dtype, head dims, causal), not by sizes (the backward's
        # main kernel also by walk length: the long calls' one is built below)
        q = torch.randn(1, 128, 2, d, device=dev, dtype=tdt[dt], requires_grad=has_bwd)
        k = torch.randn(1, 128, 2, d, device=dev, dtype=tdt[dt], requires_grad=has_bwd)
        v = torch.randn(1, 128, 2, dv, device=dev, dtype=tdt[dt], requires_grad=has_bwd)
        cfg = (dt, d, dv, c)
        tasks.append(("fwd", cfg, lambda q=q, k=k, v=v, c=c: flash_attn_func(q, k, v, causal=c), "", {}))
        if has_bwd and has_backward(arch, d, dv):
            tasks.append(("bwd", cfg, lambda q=q, k=k, v=v, c=c: flash_attn_func(q, k, v, causal=c).sum().backward(),
                          "", {}))
        if has_varlen:
            cu = torch.tensor([0, 64, 128], dtype=torch.int32, device=dev)
            tasks.append(("varlen", cfg, lambda q=q, k=k, v=v, c=c, cu=cu: flash_attn_varlen_func(
                q.detach()[0], k.detach()[0], v.detach()[0], cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=64,
                max_seqlen_k=64, causal=c), "", {}))
    for b in lpt:  # built, not run: the kernels a long causal call of these heads would compile
        tasks.append(("fwd lpt", *_lpt_task(fwd_mod, b)))
    if backend.AHEAD_LONG_BUILDS:
        # built, not run: what long non-causal calls add (the Hopper forward's split_tail kernels), and
        # every backward main kernel (the short calls above may have run the persistent one)
        bwd_mod = backend.backward_module() if has_bwd and any(has_backward(arch, d, dv) for _, d, dv, _ in cfgs) \
            else None
        for dt, d, dv, c in cfgs:
            if not c:
                tasks.append(("fwd long", (dt, d, dv, c), functools.partial(
                    fwd_mod.compile_launchable, dtype=dt, head_dim=d, head_dim_v=dv, causal=False), "", {}))
            if bwd_mod is not None and has_backward(arch, d, dv):
                tasks.append(("bwd long", (dt, d, dv, c), functools.partial(
                    bwd_mod.compile_launchable, dtype=dt, head_dim=d, head_dim_v=dv, causal=c), "", {}))
    prog = Progress(len(tasks), out)
    results = []
    for kind, (dt, d, dv, c), fn, prefix, extra in tasks:
        before = _cache.stats()
        t0 = time.perf_counter()
        row = {"kind": kind, "dtype": dt, "head_dim": d, "head_dim_v": dv, "causal": c, **extra}
        try:
            fn()
            torch.cuda.synchronize()
            row["seconds"] = time.perf_counter() - t0
            after = _cache.stats()
            src = ("loaded from disk" if after["disk_hits"] > before["disk_hits"] else
                   "compiled" if after["misses"] > before["misses"] else "already in memory")
            row["source"] = src
            detail = f"{prefix}{src} in {row['seconds']:.2f} s"
        except Exception as exc:
            row.update(seconds=time.perf_counter() - t0, error=f"{type(exc).__name__}: {exc}"[:300])
            detail = f"{prefix}FAILED {row['error'][:100]}"
        results.append(row)
        prog.step(_label(kind, dt, d, dv, c), detail)
    st = _cache.stats()
    print(f"done in {prog.elapsed():.1f} s: {st['misses']} compiled, {st['disk_hits']} loaded from disk, "
          f"{st['stores']} written to {_cache.cache_dir()}", file=out)
    return results


# ---------------------------------------------------------------------------------------------
# --shapes / --model-config: exactly the builds a model's calls launch (either path)
# ---------------------------------------------------------------------------------------------
def _variant_text(variant: dict) -> str:
    w = variant.get("window_size", (None, None))
    text = "" if tuple(w) == (None, None) else f" window={w[0]}" + ("" if w[1] in (None, 0) else f"/{w[1]}")
    text += f" softcap={variant['softcap']:g}" if variant.get("softcap") else ""
    return text + (" sink" if variant.get("learnable_sink") else "")


def derived_task(fwd_mod, bwd_mod, build: dict):
    """(label, what to build, label detail) of one `derive_builds` entry: the module's
    compile_launchable under the launch's cache key."""
    kind = build["kind"]
    kw = dict(dtype=build["dtype"], head_dim=build["head_dim"], head_dim_v=build["head_dim_v"],
              causal=build["causal"], **build["variant"])
    label = _label(kind, build["dtype"], build["head_dim"], build["head_dim_v"], build["causal"])
    label += _variant_text(build["variant"])
    if kind.startswith("bwd"):
        return label, functools.partial(bwd_mod.compile_launchable, varlen=kind == "bwd varlen", **kw), ""
    if kind == "page gather":
        from stage3_fwd_kernel import page_gather

        return "page gather (K and V, any dtype)", lambda: [page_gather.compile_gather(launchable=True)], ""
    if kind == "combine":
        from stage3_fwd_kernel import split_combine

        # both merges: rows as the parts hold them, and GQA heads packed by query token (unpacked as merged)
        return label, lambda: [split_combine.compile_parts(build["dtype"], build["head_dim_v"], launchable=True,
                                                           token_rows=token_rows) for token_rows in (False, True)], ""
    if kind == "kvcache split":
        rows = build["rows_per_query"]
        return label + (f" rows/query={rows}" if rows > 1 else ""), lambda: [fwd_mod.compile_only(
            seqused_k=True, key_split=True, tile_m=build["tile_m"], rows_per_query=rows, launchable=True, **kw)], ""
    extra, prefix = {}, ""
    if build.get("tile_m"):
        extra["tile_m"] = build["tile_m"]
    if kind == "kvcache":
        extra["seqused_k"] = True
    if kind == "fwd lpt":
        extra["scheduler"] = build["scheduler"]
        first, last = build["seqlen_range"]
        prefix = f"{build['scheduler'].heads_per_section} heads/section, keys {first}-{last}, heads {build['heads']}: "
    elif kind == "fwd long":
        prefix = f"keys >= {build['seqlen_k']}: "
    return label, functools.partial(fwd_mod.compile_launchable, varlen=kind in ("varlen", "kvcache"),
                                    seqlen_k=build["seqlen_k"], **extra, **kw), prefix


def build_derived(builds: list, *, arch_key: str = "sm_90", gpu: bool = False, out=None) -> list[dict]:
    """Compile `derive_builds`' list through the stage modules' compile_launchable (built, not run,
    on a GPU too), so each kernel lands in the disk cache under the key its launch computes."""
    from . import _cache
    from ._dispatch import ARCHS, _install_disk_cache, make_backend

    out = out or sys.stdout
    info = ARCHS[arch_key]
    if gpu:
        from ._dispatch import backend_for
        import torch

        backend = backend_for(torch.device("cuda", torch.cuda.current_device()))
    else:
        _ensure_arch(info.cute_arch)
        backend = make_backend(info)
    if not backend.LAUNCHABLE_BUILDS:
        print(f"--shapes / --model-config: {info.forward_module} has no launchable builds; use --head-dims",
              file=out)
        return [{"error": "no launchable builds"}]
    fwd_mod = backend.forward_module()  # imports the module and installs the disk cache
    bwd_mod = backend.backward_module() if any(b["kind"].startswith("bwd") for b in builds) else None
    _install_disk_cache()
    where = f"disk cache: {_cache.cache_dir()}" if _cache.enabled() else "disk cache disabled (FA4_CACHE=0)"
    print(f"{'GPU' if gpu else 'no GPU'}: {len(builds)} build(s) for {info.cute_arch} derived from the shapes; {where}",
          file=out, flush=True)
    prog = Progress(len(builds), out)
    results = []
    for b in builds:
        label, build, prefix = derived_task(fwd_mod, bwd_mod, b)
        row = {k: v for k, v in b.items() if k != "scheduler"}
        if "scheduler" in b:
            row["heads_per_section"] = b["scheduler"].heads_per_section
        before, t0 = _cache.stats(), time.perf_counter()
        try:
            comps = build()
            row.update(seconds=time.perf_counter() - t0, kernels=len(comps))
            main = max(comps, key=lambda comp: comp.report.get("registers") or 0)
            detail = (f"{prefix}{len(comps)} kernel(s) in {row['seconds']:.1f} s, "
                      f"{_state(before, _cache.stats(), True, row)}  {_resources(main.report)}")
        except Exception as exc:  # report and continue: the point is the whole table
            row.update(seconds=time.perf_counter() - t0, error=f"{type(exc).__name__}: {exc}"[:300])
            detail = f"{prefix}FAILED {row['error'][:100]}"
        results.append(row)
        prog.step(label, detail)
    st = _cache.stats()
    print(f"done: {len(results)} builds in {prog.elapsed():.1f} s, {st['stores']} kernels written, "
          f"{st['disk_hits']} already on disk", file=out)
    return results


def _derived_workloads(args) -> Optional[list]:
    """The workloads of --shapes and --model-config (None when neither is given); the dtype and
    max-seqlen options apply to the model config."""
    shapes = [w for group in (getattr(args, "shapes", None) or []) for w in group]
    config = getattr(args, "model_config", None)
    if not shapes and not config:
        return None
    if args.max_seqlen is not None:  # the default longest key length of shapes without seqlen=
        shapes = [w if w.max_seqlen else replace(w, max_seqlen=args.max_seqlen) for w in shapes]
    if config:
        dtypes = args.dtype.split(",") if args.dtype else [None]
        if len(dtypes) > 1 or dtypes[0] not in (None, *DTYPES):
            raise ValueError(f"--dtype: one of {', '.join(DTYPES)} with --model-config, got {args.dtype!r}")
        dtype = dtypes[0]
        shapes += workloads_from_config(load_model_config(config), dtype=dtype, max_seqlen=args.max_seqlen)
    if getattr(args, "decode", False):
        shapes = [replace(w, decode=True) for w in shapes]
    return shapes


def record_plans(workloads: Iterable[Workload], batches: Iterable[int], *, backward: bool = True, out=None) -> list:
    """--plans (needs a GPU): run each workload's exact call -- contiguous (batch, seqlen, heads, d)
    q, k, v of one length, for every batch size given -- twice, forward and (unless --no-backward) the
    backward of out.float().sum(), so that fa4 records its launch plans (fa4/_plans.py) beside the
    kernels. A later process making the same call replays them without importing CuTe-DSL (the first
    call's 0.5 s goal). Only calls of exactly these shapes, dtypes and strides match a plan; a model's
    own second calls record any others. Returns one row per call: recorded / unrecordable counts."""
    import torch

    import fa4
    from . import _plans

    out = out or sys.stdout
    rows = []
    for w in workloads:
        if w.max_seqlen is None:
            raise ValueError(f"--plans: give each --shapes item its length (seqlen=N), got {w}")
        for b in batches:
            s = w.max_seqlen
            # the inputs `fa4 firstcall` measures with (its _inputs), so its "precompiled" run replays these
            dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[w.dtype]
            q, k, v = (torch.randn(b, s, h, dim, device="cuda", dtype=dt, requires_grad=backward)
                       for h, dim in ((w.heads_q, w.head_dim), (w.heads_kv, w.head_dim), (w.heads_kv, w.head_dim_v)))
            sink = torch.zeros(w.heads_q, device="cuda", requires_grad=backward) if w.sink else None
            before = _plans.stats()
            outs = [fa4.flash_attn_func(q, k, v, causal=w.causal, window_size=w.window or (None, None),
                                        softcap=w.softcap, learnable_sink=sink) for _ in range(2)]
            if backward:
                for o in outs:
                    o.float().sum().backward()
            torch.cuda.synchronize()
            after = _plans.stats()
            row = dict(batch=b, seqlen=s, workload=str(w), recorded=after["recorded"] - before["recorded"],
                       unrecordable=after["unrecordable"] - before["unrecordable"])
            rows.append(row)
            print(f"plans  {w.dtype} d={w.head_dim}/{w.head_dim_v} heads={w.heads_q}/{w.heads_kv} batch={b} "
                  f"seqlen={s}{' causal' if w.causal else ''}: {row['recorded']} recorded"
                  + (f", {row['unrecordable']} not recordable" if row["unrecordable"] else ""), file=out, flush=True)
    return rows


def _parse_head_dims(text: str) -> list:
    """--head-dims "64,128,192/128" -> [64, 128, (192, 128)]; ValueError naming the option."""
    bad = ValueError(f"--head-dims: expected comma-separated D or QK/V positive integers (e.g. 64,128,192/128), "
                     f"got {text!r}")
    try:
        dims = [int(x) if "/" not in x else tuple(int(y) for y in x.split("/")) for x in text.split(",")]
    except ValueError:
        raise bad from None
    flat = [d if isinstance(d, tuple) else (d,) for d in dims]
    if any(isinstance(d, tuple) and len(d) != 2 for d in dims) or any(v < 1 for f in flat for v in f):
        raise bad
    return dims


def main(args) -> int:
    try:
        import torch

        gpu = torch.cuda.is_available()
    except ImportError:
        gpu = False
    arch_key = {"sm_90a": "sm_90", "sm_100a": "sm_100"}[args.arch] if args.arch else None
    if gpu and not args.arch:
        from ._dispatch import UnsupportedDeviceError, arch_for_capability

        try:
            arch_key = arch_for_capability(torch.cuda.get_device_capability()).key
        except UnsupportedDeviceError as exc:
            print(f"{str(exc).split(': ', 1)[-1]} Build for one of them on this machine with --arch sm_90a or "
                  "--arch sm_100a.", file=sys.stderr)
            return 2
    arch_key = arch_key or "sm_90"
    l2_bytes = getattr(args, "l2_bytes", None)
    if l2_bytes is not None and args.arch != "sm_100a":
        print("--l2-bytes: only with --arch sm_100a (sm_90's LPT sections are sized for an H100's L2; on a "
              "Blackwell GPU without --arch, its own L2 is used)", file=sys.stderr)
        return 2
    if gpu and not args.arch and arch_key == "sm_100":
        from ._dispatch import _l2_bytes

        l2_bytes = _l2_bytes(torch.device("cuda", torch.cuda.current_device()))
    if getattr(args, "shapes", None) is not None and not any(getattr(args, "shapes")):
        print("--shapes: the spec is empty (an unset shell variable?); give at least one workload", file=sys.stderr)
        return 2
    try:
        workloads = _derived_workloads(args)
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError) as exc:
        print(f"--shapes / --model-config: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    plans = getattr(args, "plans", None)
    if plans and not args.shapes:
        print("--plans: only with --shapes (each item's seqlen is the recorded call's length)", file=sys.stderr)
        return 2
    for flag in ("decode", "varlen"):  # read only on the --shapes / --model-config path: not silently ignored
        if getattr(args, flag, False) and workloads is None:
            print(f"--{flag}: only with --shapes / --model-config", file=sys.stderr)
            return 2
    if workloads is not None:
        clash = [opt for opt, on in (("--all", args.all), ("--head-dims", args.head_dims),
                                     ("--causal", args.causal != "both"), ("--heads", getattr(args, "heads", None)),
                                     ("--dtype", args.dtype and not getattr(args, "model_config", None)))
                 if on]
        if clash:
            print(f"--shapes / --model-config say what to build (a --shapes item's dtype= too): leave out "
                  f"{', '.join(clash)}", file=sys.stderr)
            return 2
        if plans and not (gpu and not args.arch):
            print("--plans: needs a CUDA GPU (it runs the calls) and no --arch", file=sys.stderr)
            return 2
        if plans and any(w.max_seqlen is None for w in workloads):
            print("--plans: give each --shapes item its length (seqlen=N): the recorded call is that long",
                  file=sys.stderr)
            return 2
        if args.arch:  # deriving LPT builds imports cutlass (stage 5's scheduler): the target first
            from ._dispatch import ARCHS

            _ensure_arch(ARCHS[arch_key].cute_arch)
        try:
            builds = derive_builds(workloads, arch_key, backward=not args.no_backward,
                                   varlen=getattr(args, "varlen", False), l2_bytes=l2_bytes)
        except ValueError as exc:
            print(f"--shapes / --model-config: {exc}", file=sys.stderr)
            return 2
        for note in arch_notes(workloads, arch_key, l2_bytes):
            print(note)
        rows = build_derived(builds, arch_key=arch_key, gpu=gpu and not args.arch)
        if plans:
            try:
                rows += record_plans(workloads, plans, backward=not args.no_backward)
            except ValueError as exc:
                print(str(exc), file=sys.stderr)
                return 2
        return 1 if any("error" in r or r.get("unrecordable") for r in rows) else 0
    causal = {"both": None, "yes": True, "no": False}[args.causal]
    dts = args.dtype.split(",") if args.dtype else None
    if dts and any(dt not in DTYPES for dt in dts):
        print(f"--dtype: expected a comma list of {', '.join(DTYPES)}, got {args.dtype!r}", file=sys.stderr)
        return 2
    try:
        hds = _parse_head_dims(args.head_dims) if args.head_dims else None
        cfgs = configs(args.all, dts, hds, causal, arch=arch_key)
    except ValueError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    heads = getattr(args, "heads", None)
    max_seqlen = getattr(args, "max_seqlen", None)
    if max_seqlen is not None and not heads:
        print("--max-seqlen: only meaningful with --heads (it bounds the LPT kernels' key lengths)", file=sys.stderr)
        return 2
    max_seqlen = DEFAULT_MAX_SEQLEN if max_seqlen is None else max_seqlen
    if gpu and not args.arch:
        rows = on_gpu(cfgs, backward=not args.no_backward, heads=heads, max_seqlen=max_seqlen)
    else:
        from ._dispatch import ARCHS

        rows = compile_only(cfgs, arch=ARCHS[arch_key].cute_arch, backward=not args.no_backward, heads=heads,
                            max_seqlen=max_seqlen, l2_bytes=l2_bytes)
    return 1 if any("error" in r for r in rows) else 0


def add_arguments(p):
    p.add_argument("--all", action="store_true", help="every supported dtype x head dims x causal of the arch")
    p.add_argument("--dtype", default=None, help="comma list of bf16,fp16 (default bf16)")
    p.add_argument("--head-dims", default=None, help="comma list, e.g. 64,128,192/128 (default 64,128)")
    p.add_argument("--causal", default="both", choices=["both", "yes", "no"])
    p.add_argument("--arch", default=None, choices=["sm_90a", "sm_100a"],
                   help="compile-only for this arch with fake tensors (the default without a GPU: sm_90a)")
    p.add_argument("--no-backward", action="store_true", help="forward kernels only")
    p.add_argument("--l2-bytes", type=_positive_int, default=None, metavar="BYTES",
                   help="with --arch sm_100a: the target GPU's L2 size (torch.cuda.get_device_properties(0)"
                        ".L2_cache_size), so the LPT-ordered causal forwards, whose sections follow it, are built too")
    p.add_argument("--heads", type=parse_heads, default=None, metavar="HQ[/HKV],...",
                   help="also build the LPT-ordered causal forwards these head counts launch with >= 4096 keys, "
                        "e.g. 32/8,16")
    p.add_argument("--max-seqlen", type=_positive_int, default=None,
                   help=f"longest key length the LPT kernels cover (with --heads; default {DEFAULT_MAX_SEQLEN}; "
                        "with --model-config default the config's max_position_embeddings)")
    p.add_argument("--shapes", type=parse_shapes, action="append", default=None, metavar="SPEC[;SPEC...]",
                   help="build exactly what these calls launch, e.g. 'd=128,heads=32/8,causal,seqlen=4096' "
                        "(items: d=D[/DV], heads=HQ[/HKV], causal|noncausal, seqlen=MAX_KEYS, dtype=bf16|fp16, "
                        "window=LEFT[/RIGHT], softcap=X, sink, decode); replaces --head-dims / --causal / --heads")
    p.add_argument("--model-config", default=None, metavar="CONFIG.JSON",
                   help="build exactly what a Hugging Face model's attention launches (head_dim, GQA heads, "
                        "causal, sliding_window / layer_types, attn_logit_softcapping, gpt-oss sinks, LPT kernels "
                        "up to --max-seqlen or max_position_embeddings)")
    p.add_argument("--varlen", action="store_true",
                   help="with --shapes / --model-config: also the varlen forward (and backward) kernels and the "
                        "page gather of paged caches that are copied")
    p.add_argument("--plans", type=_batch_list, default=None, metavar="B[,B...]",
                   help="with --shapes on a GPU: also run each call (these batch sizes, the item's seqlen as its "
                        "length) twice so fa4 records its launch plans: a later process then skips importing "
                        "CuTe-DSL for exactly these calls")
    p.add_argument("--decode", action="store_true",
                   help="with --shapes / --model-config: also what decoding launches (<= 64 query rows: "
                        "flash_attn_func, and flash_attn_with_kvcache's forward and split-KV merge; the page "
                        "gather of paged caches that are copied)")


def _positive_int(text: str) -> int:
    import argparse

    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _batch_list(text: str) -> list[int]:
    sizes = [_positive_int(x) for x in str(text).split(",") if x.strip()]
    if not sizes:  # "" or "," (an unset shell variable?) would otherwise read as no --plans at all
        import argparse

        raise argparse.ArgumentTypeError(f"expected batch sizes B[,B...], got {text!r}")
    return sizes


def run(argv: Optional[list] = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m fa4 precompile", description=__doc__.splitlines()[0])
    add_arguments(p)
    return main(p.parse_args(argv))
