"""Decode against a KV cache: achieved bandwidth of fa4, the official FlashAttention-4 and cuDNN.

    python -m benchmarks.bench_decode [--shapes 1x8192,1x131072,8x32768,64x8192,64x32768] [--rounds 5]
                                      [--query-len 1] [--heads 32/8] [--window LEFT] [--cache-batch-idx]
                                      [--out benchmarks/results/bench_decode_h200.json]

bf16, GQA 32 / 8 (--heads), d = 128, one query token per sequence (--query-len N > 1: N causal tokens
at the cache's end, speculative decoding), a dense cache filled to its length. --window LEFT:
window_size=(LEFT, 0), causal (a sliding-window layer); the bytes are then those of the keys in the
window, and the copy peer copies that slice of K. cuDNN has no window through SDPA and is left out.
Achieved GB/s = bytes of Q, K and V read / time, next to a device copy of K in the same run. The
issue's yardstick also counts the output written, left out here: 0.03% of the bytes at one token over a
whole cache, up to 0.2% under a 1024-key window and 0.8% with four tokens there. Peers:

* fa4_kvcache: fa4.flash_attn_with_kvcache (split-KV chosen from batch, heads, length and SMs; GQA
  heads packed into one tile);
* fa4_func: fa4.flash_attn_func on the same tensors: under no_grad a decode-shaped call takes the split
  launch too (fa4/_decode_route.py);
* fa4_func_unrouted: the same call with that route off (fa4._dispatch.DECODE_ROUTE_MAX_QUERY = None at
  capture): the attention kernel's own grid, no split, no packing -- the path a call that needs a
  gradient takes;
* official: flash_attn.cute.interface.flash_attn_func (flash-attn-4), where installed;
* sdpa_cudnn: torch SDPA on (B, H, N, D) with enable_gqa, cuDNN backend (N > 1: the lower-right
  causal bias, torch.nn.attention.bias.causal_lower_right; recorded as failed where cuDNN refuses it);
* fa4_kvcache_rows (--cache-batch-idx): fa4.flash_attn_with_kvcache with cache_batch_idx over a copy of
  the cache whose B + 1 rows hold sequence b in row B - 1 - b (a serving loop's static slots).

Every call is captured in a CUDA graph of 20 calls and the graph is replayed (what a serving loop
does; host launch overhead would otherwise hide the kernels at batch 1), in paired rounds
(benchmarks.ab_fwd.paired_rounds: every round times every peer once, in a fresh random order).
Each peer's output is checked against fa4_func's first. `--profile` lists fa4_kvcache's kernels per
call; `python -m benchmarks.bench_decode --table RESULT.json` prints fa4/README.md's table.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys

import torch

from .ab_fwd import paired_rounds
from .bench_fwd import write_doc

HQ, HKV, D = 32, 8, 128   # defaults of --heads; d
CALLS_PER_GRAPH = 20


def _graphed(fn):
    fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm the allocator on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS_PER_GRAPH):
            out = fn()
    return graph, out


def keys_read(query_len, cache, window):
    """Keys a step reads: all of the cache, or the last query_len + window of it."""
    return cache if window is None else min(cache, window + query_len)


def copy_peer(src):
    """The bandwidth yardstick: a copy kernel (reads and writes src) into a buffer made before the
    capture. A captured clone / copy_ of a contiguous slice becomes a memcpy node, which a review
    measured at ~2.7 TB/s from ~0.5 GB on against ~4.2 TB/s for a kernel (docs/measurements.md)."""
    buf = torch.empty_like(src)
    return lambda: torch.add(src, 0, out=buf)


def unrouted(fn, *args, **kwargs):
    """fn(*args, **kwargs) with fa4's decode route off (a graph captured in here replays that path)."""
    from fa4 import _dispatch

    saved, _dispatch.DECODE_ROUTE_MAX_QUERY = _dispatch.DECODE_ROUTE_MAX_QUERY, None
    try:
        return fn(*args, **kwargs)
    finally:
        _dispatch.DECODE_ROUTE_MAX_QUERY = saved


def _peers(q, k, v, window=None, cache_rows=False):
    import fa4

    causal = q.shape[1] > 1 or window is not None  # several query tokens: causal at the cache's end
    win = (None, None) if window is None else (window, 0)
    read = keys_read(q.shape[1], k.shape[1], window)
    peers = {
        "fa4_kvcache": lambda: fa4.flash_attn_with_kvcache(q, k, v, causal=causal, window_size=win),
        "fa4_func": lambda: fa4.flash_attn_func(q, k, v, causal=causal, window_size=win),
        "fa4_func_unrouted": lambda: unrouted(fa4.flash_attn_func, q, k, v, causal=causal, window_size=win),
        "sdpa_cudnn": None,
        "copy_k": copy_peer(k[:, k.shape[1] - read:]),
    }
    if cache_rows:   # sequence b in row B - 1 - b of a cache with a spare row
        b = q.shape[0]
        idx = torch.arange(b - 1, -1, -1, device=q.device, dtype=torch.int32)
        k_slots, v_slots = (torch.cat([t.flip(0), t[:1]]) for t in (k, v))
        peers["fa4_kvcache_rows"] = lambda: fa4.flash_attn_with_kvcache(q, k_slots, v_slots, cache_batch_idx=idx,
                                                                         causal=causal, window_size=win)
    try:
        from flash_attn.cute.interface import flash_attn_func as official

        peers["official"] = lambda: official(q, k, v, causal=causal, window_size=win)[0]
    except Exception as exc:  # not installed: reported, not timed
        print(f"official: not available ({type(exc).__name__}: {exc})")
    if window is not None:
        del peers["sdpa_cudnn"]
        return peers
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    bias = None
    if causal:
        from torch.nn.attention.bias import causal_lower_right

        bias = causal_lower_right(q.shape[1], k.shape[1])

    def sdpa():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, attn_mask=bias,
                                                                    enable_gqa=True).transpose(1, 2)

    peers["sdpa_cudnn"] = sdpa
    return peers


def _kernel_breakdown(graph) -> list:
    """The GPU kernels of one replay of fa4_kvcache's graph (20 calls), per call: name, us."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / CALLS_PER_GRAPH, e.count // CALLS_PER_GRAPH)
            for e in prof.key_averages() if e.device_time_total > 0]
    rows.sort(key=lambda r: -r[1])
    for name, us, n in rows:
        print(f"    {us:8.2f} us  x{n}  {name[:90]}")
    print(f"    {sum(r[1] for r in rows):8.2f} us in {sum(r[2] for r in rows)} kernels per call")
    return [{"kernel": name, "us_per_call": us, "per_call": n} for name, us, n in rows]


def run_shape(batch, cache, rounds, rng, profile=False, query_len=1, heads=(HQ, HKV), window=None, cache_rows=False):
    g = torch.Generator(device="cuda").manual_seed(batch * 7 + cache)
    q = torch.randn(batch, query_len, heads[0], D, device="cuda", generator=g, dtype=torch.bfloat16)
    k = torch.randn(batch, cache, heads[1], D, device="cuda", generator=g, dtype=torch.bfloat16)
    v = torch.randn(batch, cache, heads[1], D, device="cuda", generator=g, dtype=torch.bfloat16)
    read = keys_read(query_len, cache, window)
    k_bytes = batch * read * heads[1] * D * k.element_size()    # of the keys read (all without a window)
    nbytes = q.numel() * q.element_size() + 2 * k_bytes
    graphs, checks, row_kernels = {}, {}, None
    with torch.no_grad():
        ref = None
        for name, fn in _peers(q, k, v, window, cache_rows).items():
            try:
                graph, out = _graphed(fn)
            except Exception as exc:
                print(f"  {name}: failed ({type(exc).__name__}: {str(exc)[:200]})")
                checks[name] = f"failed: {type(exc).__name__}: {str(exc)[:300]}"
                continue
            graph.replay()
            torch.cuda.synchronize()
            if name == "fa4_func":
                ref = out.float()
            graphs[name] = (graph, out)
        for name, (_, out) in graphs.items():
            if name != "copy_k" and ref is not None:
                checks[name] = float((out.float() - ref).abs().max())
        times = paired_rounds({n: gr[0].replay for n, gr in graphs.items()}, rounds, rng)
        if profile and "fa4_kvcache" in graphs:
            row_kernels = _kernel_breakdown(graphs["fa4_kvcache"][0])
    row = {"batch": batch, "cache": cache, "query_len": query_len, "heads": list(heads), "window": window,
           "bytes": nbytes,
           "max_abs_diff_vs_fa4_func": checks, "peers": {}}
    if row_kernels is not None:
        row["fa4_kvcache_kernels"] = row_kernels
    for name, ts in times.items():
        per_call = [t / CALLS_PER_GRAPH for t in ts]
        moved = 2 * k_bytes if name == "copy_k" else nbytes   # copy reads and writes K
        row["peers"][name] = {"ms_per_call": per_call, "median_ms": statistics.median(per_call),
                              "gb_per_s": moved / (statistics.median(per_call) * 1e-3) / 1e9}
    line = " | ".join(f"{n} {p['gb_per_s']:.0f}" for n, p in row["peers"].items())
    print(f"{batch} x {cache}: GB/s {line}", flush=True)
    return row


def markdown_table(doc) -> str:
    """fa4/README.md's decode table from a results file: achieved GB/s per peer, median of the rounds."""
    names = [n for n in ("fa4_kvcache", "fa4_func", "fa4_func_unrouted", "official", "sdpa_cudnn", "copy_k")
             if any(n in r["peers"] for r in doc["results"])]
    lines = ["| batch x cache | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for r in doc["results"]:
        cells = [f"{r['peers'][n]['gb_per_s']:.0f}" if n in r["peers"] else "-" for n in names]
        lines.append(f"| {r['batch']} x {r['cache'] // 1024}k | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_shapes(flag: str, text: str) -> list:
    """'BATCHxCACHE,...' -> [(batch, cache), ...] (SystemExit naming the flag)."""
    try:
        shapes = [tuple(int(x) for x in s.split("x")) for s in text.split(",")]
    except ValueError:
        shapes = []
    if not shapes or any(len(t) != 2 or min(t) < 1 for t in shapes):
        raise SystemExit(f"{flag}: expected BATCHxCACHE,... got {text!r}")
    return shapes


def check_decode_flags(heads_flag: str, heads: str, query_len: int, window) -> tuple:
    """(HQ, HKV) from 'HQ/HKV', after checking it and --query-len / --window (SystemExit naming the flag)."""
    try:
        pair = tuple(int(x) for x in heads.split("/"))
    except ValueError:
        pair = ()
    if len(pair) != 2 or min(pair) < 1 or pair[0] % pair[1]:
        raise SystemExit(f"{heads_flag}: expected HQ/HKV with HKV >= 1 dividing HQ, got {heads!r}")
    if query_len < 1:
        raise SystemExit(f"--query-len: expected >= 1, got {query_len}")
    if window is not None and window < 0:
        raise SystemExit(f"--window: expected >= 0, got {window}")
    return pair


def printed_table(argv, table) -> bool:
    """`--table RESULT.json` as the whole command line: print table(the results file) and say so."""
    if argv[:1] != ["--table"]:
        return False
    with open(argv[1]) as f:
        print(table(json.load(f)))
    return True


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if printed_table(argv, markdown_table):  # python -m benchmarks.bench_decode --table RESULT.json
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="1x8192,1x131072,8x32768,64x8192,64x32768", help="BATCHxCACHE,...")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", action="store_true", help="also list fa4_kvcache's kernels per call (profiler)")
    ap.add_argument("--query-len", type=int, default=1, help="query tokens per sequence (> 1: causal)")
    ap.add_argument("--heads", default=f"{HQ}/{HKV}", help="query heads / KV heads")
    ap.add_argument("--window", type=int, default=None, help="window_size=(LEFT, 0), causal")
    ap.add_argument("--cache-batch-idx", action="store_true",
                    help="also time fa4_kvcache_rows: the same call through cache_batch_idx (sequence b in row B - b)")
    args = ap.parse_args(argv)
    heads = check_decode_flags("--heads", args.heads, args.query_len, args.window)
    shapes = parse_shapes("--shapes", args.shapes)
    if not torch.cuda.is_available():
        print("bench_decode needs a CUDA GPU")
        return 2
    rng = random.Random(0)
    rows = [run_shape(b, c, args.rounds, rng, args.profile, args.query_len, heads, args.window, args.cache_batch_idx)
            for b, c in shapes]
    tokens = "one query token" if args.query_len == 1 else f"{args.query_len} causal query tokens"
    if args.window is not None:
        tokens += f", window_size=({args.window}, 0) (bytes: the keys in the window)"
    if args.out:
        write_doc(args.out, "benchmarks.bench_decode", None, rows,
                  shapes=f"bf16, GQA {heads[0]}/{heads[1]}, d={D}, {tokens}, dense cache",
                  method=f"CUDA graphs of {CALLS_PER_GRAPH} calls, {args.rounds} paired rounds (random order); "
                         "GB/s = bytes of Q, K, V / time (copy_k: 2 x bytes of K)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
