"""Attention over a paged KV cache: what paging costs fa4, next to the official FlashAttention-4's paged path.

    python -m benchmarks.bench_paged [--decode-shapes 1x16384,1x131072,8x32768,64x8192,64x32768]
                                     [--prefill-seqlens 4096,8192,16384] [--page-sizes 16,64,128,256]
                                     [--rounds 5] [--out benchmarks/results/bench_paged_h200.json]
                                     [--only decode|prefill] [--window LEFT] [--query-len 1]
                                     [--decode-heads 32/8]
    python -m benchmarks.bench_paged --table RESULT.json      # markdown tables from a result file (no GPU)

bf16, GQA 32 query heads / 8 KV heads, d = 128. A paged cache is (num_pages, page_size, 8, 128) for K
and for V with a block table int32 (batch, pages per sequence), built as a server would hold it
(`build_paged`): about 1.25x the pages needed are allocated, each sequence gets a random set of
distinct pages in shuffled order (pages are not contiguous and unused pages lie between them), and
the same keys / values as a dense reference cache are written into those pages, so a paged call and
a dense call give the same output. Every point runs every page size of --page-sizes. A fa4 paged
time includes whatever fa4 does with the pages at that page size (read in place, or gathered into a
dense copy per call).

Decode (one query token per sequence, every sequence's cache filled to the same length). Peers:

* fa4_paged: fa4.flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=..., block_table=...);
* fa4_dense: the same call on the dense (B, S, 8, 128) cache, no pages (what paging costs);
* fa4_varlen_paged: fa4.flash_attn_varlen_func(q, k_pages, v_pages, page_table=..., seqused_k=...), the
  official interface's paged decode (the same split launch: fa4/_decode_route.py);
* official_paged: flash_attn.cute.interface.flash_attn_varlen_func(q, k_pages, v_pages,
  page_table=..., seqused_k=...), q (B, 1, 32, 128), where flash_attn.cute imports (its default
  num_splits = 1: SM 9.0 has no split-KV there); a page size it refuses is recorded as an error;
* copy_k: a device copy of the dense K (reads and writes K), the bandwidth yardstick;
* flashinfer_cc / flashinfer_tc: FlashInfer's BatchDecodeWithPagedKVCacheWrapper on the same pages, its
  CUDA-core and tensor-core kernels, where flashinfer-python imports (benchmarks/flashinfer_peer.py);
  `fa4 / FlashInfer` = the median over rounds of the faster FlashInfer time / fa4_paged's time.

--window LEFT: every decode peer with window_size=(LEFT, 0), causal (a sliding-window layer); the
bytes are then the keys in the window, and copy_k copies that slice of K. --query-len N > 1: N causal
query tokens at the cache's end (speculative decoding); --decode-heads HQ/HKV: the decode GQA group.

Each peer is captured in a CUDA graph of 20 calls (benchmarks.bench_decode._graphed) and the graph is
replayed in paired rounds (benchmarks.ab_fwd.paired_rounds: every round times every peer once, in a
fresh random order). Achieved GB/s = (bytes of Q + the K and V rows used, B * S * 8 * 128 * 2 bytes
each) / time. Every peer's output is checked against fa4_dense first (max |diff| <= 2e-2).

Prefill (batch * seqlen = 32768 tokens, causal, equal q / k lengths): Q varlen-packed (total, 32, 128)
with cu_seqlens_q; keys paged with page_table and seqused_k. Peers: fa4_paged =
fa4.flash_attn_varlen_func(..., page_table=..., seqused_k=..., causal=True); fa4_dense = the same call
on packed dense K / V with cu_seqlens_k; official_paged / official_dense the same through
flash_attn.cute. These calls are long, so they are timed without graphs: CUDA events around ~40 ms of
back-to-back calls per round (benchmarks.ab_fwd.time_ms), in paired rounds. TFLOP/s with causal
FLOPs = 4 * seqlen^2 * 128 * 32 * batch / 2; paged_vs_dense = the median over rounds of dense time /
paged time of the same round (decode rows carry it too). Outputs checked against fa4_dense
(max |diff| <= 5e-2, ab_fwd's bound for a causal prefill against another kernel).

Progress goes to stderr, one line per point.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from typing import NamedTuple, Optional

import torch

from .ab_fwd import paired_rounds
from .bench_decode import copy_peer
from .bench_decode import CALLS_PER_GRAPH, _graphed, check_decode_flags, keys_read
from .bench_fwd import tokens, write_doc
from . import flashinfer_peer

HQ, HKV, D = 32, 8, 128
PAGE_SLACK = 1.25             # pages allocated / pages the sequences need
PREFILL_TOKENS = 32768        # batch * seqlen of every prefill point
DECODE_TOLERANCE = 2e-2       # max |out - fa4_dense|
PREFILL_TOLERANCE = 5e-2
DECODE_PEERS = ("fa4_paged", "fa4_varlen_paged", "fa4_dense", "official_paged", "flashinfer_cc", "flashinfer_tc",
                "copy_k")
PREFILL_PEERS = ("fa4_paged", "fa4_dense", "official_paged", "official_dense")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def build_paged(k_dense, v_dense, seqlens, page_size: int, generator, slack: float = PAGE_SLACK):
    """A paged copy of a dense cache: (k_pages, v_pages, block_table).

    k_dense / v_dense (B, S, H, D); seqlens (B ints or a tensor): keys held per sequence. Returns
    k_pages / v_pages (num_pages, page_size, H, D) on k_dense's device, num_pages =
    ceil(slack * B * pages_per_seq), and block_table int32 (B, pages_per_seq), pages_per_seq =
    ceil(max(seqlens) / page_size). Every table entry is a distinct page, drawn from a random
    permutation of all pages (shuffled order, unused pages between used ones). Rows 0..seqlens[b]-1
    of sequence b are written to page block_table[b, r // page_size], slot r % page_size; every other
    row (unused pages, the tail of a partial last page) holds random finite values, so a kernel that
    reads the wrong page gets a wrong answer, never a NaN. generator: a torch.Generator; pure torch,
    works on CPU (with a CPU generator) and on CUDA (with a CUDA one)."""
    batch, s_cache, heads, dim = k_dense.shape
    if v_dense.shape[:3] != k_dense.shape[:3]:
        raise ValueError(f"v_dense {tuple(v_dense.shape)} does not match k_dense {tuple(k_dense.shape)}")
    seqlens = [int(n) for n in seqlens]
    if len(seqlens) != batch or not all(0 <= n <= s_cache for n in seqlens):
        raise ValueError(f"seqlens: need {batch} lengths in [0, {s_cache}], got {seqlens}")
    if page_size < 1:
        raise ValueError(f"page_size: must be positive, got {page_size}")
    pages_per_seq = max(1, math.ceil(max(seqlens, default=0) / page_size))
    needed = batch * pages_per_seq
    num_pages = max(needed, math.ceil(slack * needed))
    order = torch.randperm(num_pages, generator=generator, device=generator.device)
    table = order[:needed].view(batch, pages_per_seq).to(device=k_dense.device, dtype=torch.int32)
    k_pages = _random_pages(num_pages, page_size, k_dense, generator)
    v_pages = _random_pages(num_pages, page_size, v_dense, generator)
    for b, n in enumerate(seqlens):
        rows = cache_rows(table[b], n, page_size)
        k_pages.view(-1, heads, dim)[rows] = k_dense[b, :n]
        v_pages.view(-1, heads, v_dense.shape[-1])[rows] = v_dense[b, :n]
    return k_pages, v_pages, table


def cache_rows(table_row, n: int, page_size: int):
    """Flat row indices (into the pages viewed as (num_pages * page_size, H, D)) of a sequence's first n keys."""
    pos = torch.arange(n, device=table_row.device)
    return table_row.to(torch.int64)[pos // page_size] * page_size + pos % page_size


def _random_pages(num_pages: int, page_size: int, like, generator):
    shape = (num_pages, page_size, *like.shape[2:])
    return torch.randn(shape, generator=generator, device=generator.device, dtype=like.dtype).to(like.device)


def official_varlen():
    """flash_attn.cute.interface.flash_attn_varlen_func returning out only, or None (reason on stderr)."""
    try:
        from flash_attn.cute.interface import flash_attn_varlen_func
    except Exception as exc:  # not installed: reported, not timed
        log(f"official: not available ({type(exc).__name__}: {exc})")
        return None

    def call(*args, **kwargs):
        out = flash_attn_varlen_func(*args, **kwargs)
        return out[0] if isinstance(out, tuple) else out   # it may return (out, lse)
    return call


def _error_text(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc)[:300]}"


def check_outputs(outs: dict, tolerance: float, label: str, skip=("copy_k",)) -> dict:
    """name -> max |out - fa4_dense|; raises naming the peer and the point past tolerance."""
    if "fa4_dense" not in outs:
        raise RuntimeError(f"{label}: fa4_dense (the reference) did not run")
    ref = outs["fa4_dense"].float()
    diffs = {}
    for name, out in outs.items():
        if name in skip:
            continue
        diffs[name] = float((out.float() - ref).abs().max())
        if not diffs[name] <= tolerance:
            raise AssertionError(f"{label}: {name} differs from fa4_dense by max |diff| = {diffs[name]} "
                                 f"(> {tolerance})")
    return diffs


def paged_vs_dense(times: dict, paged: str, dense: str):
    """Median over rounds of dense time / paged time of the same round (> 1: paging is faster); None if absent."""
    return versus_best(times, paged, (dense,))


def versus_best(times: dict, ours: str, peers: tuple):
    """The median over rounds of (the fastest of `peers` in that round) / `ours`: above 1, ours is
    faster; None where ours or every peer is missing."""
    present = [times[p] for p in peers if p in times]
    if ours not in times or not present:
        return None
    return statistics.median(min(ts) / t for t, *ts in zip(times[ours], *present))


class DecodeCall(NamedTuple):
    """What a decode step looks like beyond its batch and cache: heads, query tokens, window."""

    heads_q: int = HQ
    heads_kv: int = HKV
    query_len: int = 1
    window: Optional[int] = None   # window_size=(window, 0), causal

    def keys_read(self, cache: int) -> int:
        return keys_read(self.query_len, cache, self.window)

    def variant(self) -> dict:
        causal = self.query_len > 1 or self.window is not None
        return ({"causal": True} if causal else {}) | ({} if self.window is None else {"window_size": (self.window, 0)})


def decode_inputs(batch: int, cache: int, page_size: int, k, v, generator, call: DecodeCall = DecodeCall()) -> dict:
    """Every tensor the decode graphs read (kept referenced until the graphs are gone)."""
    k_pages, v_pages, table = build_paged(k, v, [cache] * batch, page_size, generator)
    q = torch.randn(batch, call.query_len, call.heads_q, D, device=k.device, generator=generator, dtype=k.dtype)
    return {"q": q, "k": k, "v": v, "k_pages": k_pages, "v_pages": v_pages, "table": table,
            "seqlens": torch.full((batch,), cache, dtype=torch.int32, device=k.device)}


def decode_peers(t: dict, official, call: DecodeCall = DecodeCall(), flashinfer=None) -> dict:
    import fa4

    var, read = call.variant(), call.keys_read(t["k"].shape[1])   # the copy peer copies the keys read
    peers = {
        "fa4_paged": lambda: fa4.flash_attn_with_kvcache(t["q"], t["k_pages"], t["v_pages"],
                                                         cache_seqlens=t["seqlens"], block_table=t["table"], **var),
        "fa4_dense": lambda: fa4.flash_attn_with_kvcache(t["q"], t["k"], t["v"], cache_seqlens=t["seqlens"], **var),
        "fa4_varlen_paged": lambda: fa4.flash_attn_varlen_func(t["q"], t["k_pages"], t["v_pages"],
                                                               page_table=t["table"], seqused_k=t["seqlens"], **var),
        "copy_k": copy_peer(t["k"][:, t["k"].shape[1] - read:]),
    }
    if official is not None:
        peers["official_paged"] = lambda: official(t["q"], t["k_pages"], t["v_pages"], page_table=t["table"],
                                                   seqused_k=t["seqlens"], **var)
    if flashinfer is not None:
        peers |= flashinfer_peer.decode_peers(flashinfer, t, t["k"].shape[1], t["k_pages"].shape[1],
                                              call.query_len, call.window)
    return peers


def capture_peers(peers: dict, label: str):
    """(graphs name -> (graph, out), errors name -> text): each peer captured in a graph of 20 calls and
    replayed once; a peer that raises is recorded and left out."""
    graphs, errors = {}, {}
    for name, fn in peers.items():
        log(f"  {label}: capturing {name}")
        try:
            graph, out = _graphed(fn)
            graph.replay()
            torch.cuda.synchronize()
        except Exception as exc:
            errors[name] = _error_text(exc)
            log(f"  {label}: {name} failed ({errors[name][:200]})")
            continue
        graphs[name] = (graph, out)
    return graphs, errors


def decode_point(batch: int, cache: int, page_size: int, k, v, rounds: int, rng, official,
                 call: DecodeCall = DecodeCall(), flashinfer=None) -> dict:
    label = f"decode {batch} x {cache} page {page_size}"
    generator = torch.Generator(device="cuda").manual_seed(batch * 7 + cache + page_size)
    inputs = decode_inputs(batch, cache, page_size, k, v, generator, call)   # alive while the graphs are
    graphs, errors = {}, {}
    try:
        with torch.no_grad():
            peers = decode_peers(inputs, official, call, flashinfer)
            graphs, errors = capture_peers(peers, label)
            diffs = check_outputs({n: out for n, (_, out) in graphs.items()}, DECODE_TOLERANCE, label)
            times = paired_rounds({n: gr[0].replay for n, gr in graphs.items()}, rounds, rng)
    finally:
        graphs.clear()   # the graphs go before the tensors they read
    kv_bytes = 2 * batch * call.keys_read(cache) * call.heads_kv * D * k.element_size()
    q_bytes = inputs["q"].numel() * inputs["q"].element_size()
    row = {"section": "decode", "batch": batch, "cache": cache, "page_size": page_size, **call._asdict(),
           "num_pages": inputs["k_pages"].shape[0], "bytes": q_bytes + kv_bytes,
           "max_abs_diff_vs_fa4_dense": diffs, "errors": errors, "peers": {},
           "paged_vs_dense": paged_vs_dense(times, "fa4_paged", "fa4_dense")}
    if flashinfer is not None:
        row["fa4_vs_flashinfer"] = versus_best(times, "fa4_paged", tuple(flashinfer_peer.VARIANTS))
        row["flashinfer_backends"] = {n: peers[n].backend for n in flashinfer_peer.VARIANTS if n in peers}
    for name, ts in times.items():
        per_call = [t / CALLS_PER_GRAPH for t in ts]
        moved = kv_bytes if name == "copy_k" else q_bytes + kv_bytes   # copy_k reads and writes K
        median = statistics.median(per_call)
        row["peers"][name] = {"ms_per_call": per_call, "median_ms": median, "gb_per_s": moved / (median * 1e-3) / 1e9}
    line = " | ".join(f"{n} {p['gb_per_s']:.0f}" for n, p in row["peers"].items())
    log(f"{label}: GB/s {line}" + (f" | errors: {', '.join(errors)}" if errors else ""))
    return row


def run_decode(shapes, page_sizes, rounds: int, rng, official, call: DecodeCall = DecodeCall(),
               flashinfer=None) -> list:
    rows = []
    for batch, cache in shapes:
        generator = torch.Generator(device="cuda").manual_seed(batch * 7 + cache)
        k = torch.randn(batch, cache, call.heads_kv, D, device="cuda", generator=generator, dtype=torch.bfloat16)
        v = torch.randn(batch, cache, call.heads_kv, D, device="cuda", generator=generator, dtype=torch.bfloat16)
        for page_size in page_sizes:
            rows.append(decode_point(batch, cache, page_size, k, v, rounds, rng, official, call, flashinfer))
            torch.cuda.empty_cache()
        del k, v
        torch.cuda.empty_cache()
    return rows


def prefill_inputs(batch: int, seqlen: int, page_size: int, device="cuda") -> dict:
    """Every tensor the prefill calls read: q, k, v packed (batch * seqlen, heads, D), the paged k / v."""
    generator = torch.Generator(device=device).manual_seed(batch * 11 + seqlen + page_size)
    total = batch * seqlen
    q, k, v = (torch.randn(total, heads, D, device=device, generator=generator, dtype=torch.bfloat16)
               for heads in (HQ, HKV, HKV))
    k_pages, v_pages, table = build_paged(k.view(batch, seqlen, HKV, D), v.view(batch, seqlen, HKV, D),
                                          [seqlen] * batch, page_size, generator)
    return {"q": q, "k": k, "v": v, "k_pages": k_pages, "v_pages": v_pages, "table": table,
            "cu_seqlens": torch.arange(0, total + 1, seqlen, dtype=torch.int32, device=device),
            "seqused": torch.full((batch,), seqlen, dtype=torch.int32, device=device), "seqlen": seqlen}


def prefill_peers(t: dict, official) -> dict:
    import fa4

    lengths = {"cu_seqlens_q": t["cu_seqlens"], "max_seqlen_q": t["seqlen"], "max_seqlen_k": t["seqlen"],
               "causal": True}
    paged = {"seqused_k": t["seqused"], "page_table": t["table"]}
    peers = {
        "fa4_paged": lambda: fa4.flash_attn_varlen_func(t["q"], t["k_pages"], t["v_pages"], **lengths, **paged),
        "fa4_dense": lambda: fa4.flash_attn_varlen_func(t["q"], t["k"], t["v"], cu_seqlens_k=t["cu_seqlens"],
                                                        **lengths),
    }
    if official is not None:
        peers["official_paged"] = lambda: official(t["q"], t["k_pages"], t["v_pages"], **lengths, **paged)
        peers["official_dense"] = lambda: official(t["q"], t["k"], t["v"], cu_seqlens_k=t["cu_seqlens"], **lengths)
    return peers


def run_eagerly(peers: dict, label: str):
    """(fns name -> fn, outs name -> out, errors name -> text): each peer called twice (compile, warm)."""
    fns, outs, errors = {}, {}, {}
    for name, fn in peers.items():
        log(f"  {label}: first call of {name}")
        try:
            fn()
            outs[name] = fn()
            if outs[name].is_cuda:
                torch.cuda.synchronize()
        except Exception as exc:
            errors[name] = _error_text(exc)
            log(f"  {label}: {name} failed ({errors[name][:200]})")
            continue
        fns[name] = fn
    return fns, outs, errors


def prefill_point(seqlen: int, page_size: int, rounds: int, rng, official) -> dict:
    batch = PREFILL_TOKENS // seqlen
    label = f"prefill {batch} x {seqlen} page {page_size}"
    inputs = prefill_inputs(batch, seqlen, page_size)
    with torch.no_grad():
        fns, outs, errors = run_eagerly(prefill_peers(inputs, official), label)
        diffs = check_outputs(outs, PREFILL_TOLERANCE, label)
        outs.clear()
        times = paired_rounds(fns, rounds, rng)
    flop = 4 * seqlen ** 2 * D * HQ * batch / 2
    row = {"section": "prefill", "batch": batch, "seqlen": seqlen, "page_size": page_size,
           "num_pages": inputs["k_pages"].shape[0], "flops": flop, "max_abs_diff_vs_fa4_dense": diffs,
           "errors": errors, "peers": {},
           "fa4_paged_vs_dense": paged_vs_dense(times, "fa4_paged", "fa4_dense"),
           "official_paged_vs_dense": paged_vs_dense(times, "official_paged", "official_dense")}
    for name, ts in times.items():
        median = statistics.median(ts)
        row["peers"][name] = {"ms_rounds": ts, "median_ms": median, "tflops": flop / (median * 1e-3) / 1e12}
    line = " | ".join(f"{n} {p['tflops']:.0f}" for n, p in row["peers"].items())
    ratio = row["fa4_paged_vs_dense"]
    log(f"{label}: TFLOP/s {line}" + (f" | fa4 paged/dense {ratio:.3f}" if ratio is not None else "")
        + (f" | errors: {', '.join(errors)}" if errors else ""))
    return row


def run_prefill(seqlens, page_sizes, rounds: int, rng, official) -> list:
    rows = []
    for seqlen in seqlens:
        for page_size in page_sizes:
            rows.append(prefill_point(seqlen, page_size, rounds, rng, official))
            torch.cuda.empty_cache()
    return rows


def _cell(row: dict, name: str, metric: str) -> str:
    if name in row["peers"]:
        return f"{row['peers'][name][metric]:.0f}"
    return "err" if name in row.get("errors", {}) else "-"


def _ratio(value) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _table(rows: list, peers: tuple, metric: str, shape_key: str, shape_label: str, ratios: dict) -> str:
    """One line per (batch x length, page size): each peer's median `metric`, then the `ratios`
    (column title -> row key) as multipliers."""
    names = [n for n in peers if any(n in r["peers"] or n in r.get("errors", {}) for r in rows)]
    ratios = {title: key for title, key in ratios.items() if any(key in r for r in rows)}
    lines = [f"| {shape_label} | page | " + " | ".join(names + list(ratios)) + " |",
             "|---" * (len(names) + len(ratios) + 2) + "|"]
    for r in rows:
        cells = [_cell(r, n, metric) for n in names] + [_ratio(r.get(key)) for key in ratios.values()]
        lines.append(f"| {r['batch']} x {tokens(r[shape_key])} | {r['page_size']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def decode_table(rows: list) -> str:
    """Achieved GB/s per peer (median of the rounds), one line per (batch x cache, page size)."""
    return _table(rows, DECODE_PEERS, "gb_per_s", "cache", "batch x cache",
                  {"fa4 paged/dense": "paged_vs_dense", "fa4 / FlashInfer": "fa4_vs_flashinfer"})


def prefill_table(rows: list) -> str:
    """TFLOP/s per peer (median of the rounds) and the paged / dense ratios, one line per (shape, page size)."""
    return _table(rows, PREFILL_PEERS, "tflops", "seqlen", "batch x seqlen",
                  {"fa4 paged/dense": "fa4_paged_vs_dense", "official paged/dense": "official_paged_vs_dense"})


def markdown_tables(doc: dict) -> str:
    """The decode table (GB/s) and the prefill table (TFLOP/s), each only where the result file has rows."""
    parts = []
    for section, title, render in (("decode", "Decode, achieved GB/s", decode_table),
                                   ("prefill", "Prefill (causal), TFLOP/s", prefill_table)):
        rows = [r for r in doc["results"] if r.get("section") == section]
        if rows:
            parts.append(f"{title}\n\n{render(rows)}")
    return "\n\n".join(parts)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--decode-shapes", default="1x16384,1x131072,8x32768,64x8192,64x32768", help="BATCHxCACHE,...")
    ap.add_argument("--prefill-seqlens", default="4096,8192,16384",
                    help=f"SEQLEN,... (batch = {PREFILL_TOKENS} // seqlen)")
    ap.add_argument("--page-sizes", default="16,64,128,256")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None, help="results JSON")
    ap.add_argument("--only", choices=("decode", "prefill"), default=None, help="run one section only")
    ap.add_argument("--window", type=int, default=None, help="decode with window_size=(LEFT, 0), causal")
    ap.add_argument("--query-len", type=int, default=1, help="decode query tokens per sequence (> 1: causal)")
    ap.add_argument("--decode-heads", default=f"{HQ}/{HKV}", help="decode query heads / KV heads")
    ap.add_argument("--no-flashinfer", action="store_true", help="leave FlashInfer out of the decode peers")
    ap.add_argument("--table", metavar="RESULT.json", default=None,
                    help="print the markdown tables of a result file and exit (no GPU needed)")
    args = ap.parse_args(argv)
    try:
        args.decode_shapes = [tuple(int(x) for x in s.split("x")) for s in args.decode_shapes.split(",")]
        args.prefill_seqlens = [int(s) for s in args.prefill_seqlens.split(",")]
        args.page_sizes = [int(s) for s in args.page_sizes.split(",")]
    except ValueError:
        raise SystemExit("--decode-shapes BATCHxCACHE,..., --prefill-seqlens N,..., --page-sizes N,...: integers")
    if any(len(s) != 2 for s in args.decode_shapes):
        raise SystemExit(f"--decode-shapes: expected BATCHxCACHE,... got {args.decode_shapes}")
    bad = [s for s in args.prefill_seqlens if s <= 0 or PREFILL_TOKENS % s]
    if bad:
        raise SystemExit(f"--prefill-seqlens: {bad} do not divide {PREFILL_TOKENS} tokens")
    heads = check_decode_flags("--decode-heads", args.decode_heads, args.query_len, args.window)
    args.call = DecodeCall(heads[0], heads[1], args.query_len, args.window)
    if any(p <= 0 for p in args.page_sizes):
        raise SystemExit(f"--page-sizes: must be positive, got {args.page_sizes}")
    return args


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.table:
        with open(args.table) as f:
            print(markdown_tables(json.load(f)))
        return 0
    if not torch.cuda.is_available():
        print("bench_paged needs a CUDA GPU", file=sys.stderr)
        return 2
    rng, official, rows = random.Random(0), official_varlen(), []
    if args.only in (None, "decode"):
        flashinfer = None if args.no_flashinfer else flashinfer_peer.load()
        rows += run_decode(args.decode_shapes, args.page_sizes, args.rounds, rng, official, args.call, flashinfer)
    if args.only in (None, "prefill"):
        rows += run_prefill(args.prefill_seqlens, args.page_sizes, args.rounds, rng, official)
    print(markdown_tables({"results": rows}))
    if args.out:
        write_doc(args.out, "benchmarks.bench_paged", argv, rows,
                  shapes=f"bf16, d={D}; paged caches (num_pages, page_size, heads_kv, {D}), {PAGE_SLACK}x the "
                         f"pages needed, shuffled; decode GQA {args.call.heads_q}/{args.call.heads_kv}, {args.call}"
                         + ("" if args.window is None else ", bytes of the keys read")
                         + f"; prefill GQA {HQ}/{HKV}, {PREFILL_TOKENS} tokens, causal",
                  method=f"decode: CUDA graphs of {CALLS_PER_GRAPH} calls; prefill: CUDA events around ~40 ms of "
                         f"calls; {args.rounds} paired rounds (random order); decode GB/s = bytes of Q + K, V rows "
                         "used / time (copy_k: 2 x bytes of K); prefill TFLOP/s with causal FLOPs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
