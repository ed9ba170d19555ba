"""The attention variants against the official FlashAttention-4: sliding window, softcap, learnable sink.

    python -m benchmarks.bench_variants [--dims 128] [--seqlen 8192] [--rounds 5] [--out variants.json]
    python -m benchmarks.bench_variants --table A.json [B.json ...]   # the markdown table, no GPU

Both sides go through their public functions (`fa4.flash_attn_func`, `flash_attn.cute.interface.
flash_attn_func`) with the same arguments, forward and backward (the backward timed on a retained
graph, `torch.autograd.grad` of the output), in paired rounds (benchmarks.ab_fwd: every round times
both in a fresh random order, the ratio is official time / fa4 time of that round). The cases: plain
causal (the reference), causal with a 1024-token window, a band of 1024 keys each side (not causal),
softcap 30, causal with a sink. Then the window's cost at --window-seqlen (default 16k): fa4's
1024-window causal call against its causal and its non-causal call, next to window / seqlen (the
ratio to expect against the non-causal call when the cost follows the keys walked), in time and in SM
cycles (the clock sampled while each call is timed: benchmarks.sm_clock); `--cases ""` runs that part
alone. Each case is
compiled and checked against the official output once before timing; an implementation that refuses
a case is reported, not timed.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys

import torch

from .ab_fwd import paired_rounds, write_results
from .bench_fwd import tokens

CASE_LABELS = {"causal": "causal (no variant)", "causal+window1024": "causal + window (1024, 0)",
               "band1024": "window (1024, 1024), not causal", "softcap30": "softcap 30, not causal",
               "causal+sink": "causal + learnable sink"}
CASES = {  # name -> (causal, fa4 / official keyword arguments)
    "causal": (True, {}),
    "causal+window1024": (True, dict(window_size=(1024, 0))),
    "band1024": (False, dict(window_size=(1024, 1024))),
    "softcap30": (False, dict(softcap=30.0)),
    "causal+sink": (True, dict(learnable_sink="sink")),
}


def fwd_bwd_calls(impl, q, k, v, causal, kw):
    """(forward call, backward call on a retained graph) of one implementation."""
    def fwd():
        out = impl(q, k, v, causal=causal, **kw)
        return out[0] if isinstance(out, tuple) else out

    out = fwd()
    dout = torch.randn_like(out)
    inputs = [t for t in (q, k, v, kw.get("learnable_sink")) if t is not None]

    def bwd():
        return torch.autograd.grad(out, inputs, dout, retain_graph=True)

    return fwd, bwd, out


def _impls():
    import fa4
    from flash_attn.cute.interface import flash_attn_func as official

    return {"fa4": fa4.flash_attn_func, "official": official}


def run_case(name, d, seqlen, rounds, rng, impls):
    causal, kw = CASES[name]
    b, h = max(1, 32768 // seqlen), 2048 // d
    g = torch.Generator(device="cuda").manual_seed(d + seqlen)
    q, k, v = (torch.randn(b, seqlen, h, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True)
               for _ in range(3))
    if kw.get("learnable_sink") == "sink":
        kw = dict(kw, learnable_sink=torch.randn(h, device="cuda", generator=g).requires_grad_(True))
    fns, outs, refused = {"fwd": {}, "bwd": {}}, {}, {}
    for n, impl in impls.items():
        try:
            f, bw, outs[n] = fwd_bwd_calls(impl, q, k, v, causal, kw)
            fns["fwd"][n] = f
            bw()
            fns["bwd"][n] = bw
        except Exception as err:  # noqa: BLE001 - a refusal is a result here
            refused[n] = f"{type(err).__name__}: {str(err)[:160]}"
    rows = []
    if "fa4" in outs and "official" in outs:
        err = (outs["fa4"].float() - outs["official"].float()).abs().max().item()
        if err > 0.05:
            raise SystemExit(f"{name} d={d}: fa4 and the official output differ by {err:.3g}")
    for direction in ("fwd", "bwd"):
        times = paired_rounds(fns[direction], rounds, rng)
        row = {"case": name, "direction": direction, "head_dim": d, "seqlen": seqlen, "batch": b, "heads": h,
               "refused": refused, "ms_rounds": times,
               "ms_median": {n: statistics.median(t) for n, t in times.items()}}
        if "official" in times and "fa4" in times:
            ratios = [o / f for o, f in zip(times["official"], times["fa4"])]
            row.update(ratio_median=statistics.median(ratios), ratio_min=min(ratios), ratio_max=max(ratios))
            print(f"{name:18} d={d:3} {direction} fa4 {row['ms_median']['fa4']:.3f} ms  official "
                  f"{row['ms_median']['official']:.3f} ms  x{row['ratio_median']:.3f} "
                  f"[{row['ratio_min']:.3f}, {row['ratio_max']:.3f}]", flush=True)
        else:
            print(f"{name:18} d={d:3} {direction} timed {sorted(times)}; refused: {refused}", flush=True)
        rows.append(row)
    return rows


def window_pair_shares(seqlen: int, window: int) -> dict:
    """The (query, key) pairs of causal + (window, 0) attention at seqlen as a share of causal's and of
    non-causal attention's pairs: the time ratios a kernel would show if every pair cost the same in all
    three calls. {"causal": ~2 window / seqlen, "full": ~window / seqlen}."""
    from stage3_fwd_kernel.runner import visible_pairs

    pairs = visible_pairs(seqlen, seqlen, window, 0, True)
    return {"causal": pairs / visible_pairs(seqlen, seqlen, None, None, True), "full": pairs / (seqlen * seqlen)}


def window_cost(d, seqlen, window, rounds, rng):
    """fa4 at one seqlen: causal + (window, 0) against causal and against non-causal attention; the
    keys a row walks are ~window, ~seqlen / 2 and seqlen, so the time ratios to expect are about
    2 window / seqlen and window / seqlen. The SM clock is sampled while each call is timed
    (benchmarks.sm_clock): a long non-causal call and a short windowed one do not run at the same
    clock, so the ratios are also given in cycles (time x the span's mean clock), per round."""
    import fa4

    from .sm_clock import ClockLog

    b, h = max(1, 32768 // seqlen), 2048 // d
    g = torch.Generator(device="cuda").manual_seed(seqlen)
    q, k, v = (torch.randn(b, seqlen, h, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True)
               for _ in range(3))
    rows = []
    calls = {"full": fwd_bwd_calls(fa4.flash_attn_func, q, k, v, False, {}),
             "causal": fwd_bwd_calls(fa4.flash_attn_func, q, k, v, True, {}),
             "window": fwd_bwd_calls(fa4.flash_attn_func, q, k, v, True, dict(window_size=(window, 0)))}
    for direction, i in (("fwd", 0), ("bwd", 1)):
        spans = []
        with ClockLog(q.device.index or 0) as clocks:
            times = paired_rounds({n: c[i] for n, c in calls.items()}, rounds, rng, spans=spans)
        mhz = {n: [None] * rounds for n in calls}
        for n, r, t0, t1 in spans:
            mhz[n][r] = clocks.mean_mhz(t0, t1)
        shares = window_pair_shares(seqlen, window)
        row = {"case": f"window{window}_cost", "direction": direction, "head_dim": d, "seqlen": seqlen,
               "window": window, "ms_rounds": times, "mhz_rounds": mhz, "window_over_seqlen": window / seqlen,
               "pair_share_causal": shares["causal"], "pair_share_full": shares["full"]}
        for peer in ("causal", "full"):
            row[f"window_over_{peer}"] = statistics.median(w / c for w, c in zip(times["window"], times[peer]))
            cycles = [(w * wm) / (c * cm) for w, c, wm, cm in zip(times["window"], times[peer], mhz["window"],
                                                                  mhz[peer]) if wm and cm]
            row[f"window_over_{peer}_cycles"] = statistics.median(cycles) if cycles else None
        rows.append(row)
        in_cycles = row["window_over_full_cycles"]
        print(f"window {window} at {seqlen} d={d} {direction}: {row['window_over_causal']:.3f} of the causal time, "
              f"{row['window_over_full']:.3f} of the non-causal time"
              + (f" ({in_cycles:.3f} in SM cycles)" if in_cycles else " (no SM clock samples)")
              + f" (window / seqlen = {window / seqlen:.4f}; its pairs are {shares['causal']:.4f} of causal's, "
              f"{shares['full']:.4f} of non-causal's)", flush=True)
    return rows


def markdown_table(docs: list) -> str:
    """Official time / fa4 time (median of the rounds) per case, one column per (head dim, direction),
    the values of the result files `docs` joined by " / " in their order ("-" where one lacks the point)."""
    ratio = {(r["case"], r["head_dim"], r["direction"], i): r["ratio_median"]
             for i, doc in enumerate(docs) for r in doc["results"] if "ratio_median" in r}
    dims = sorted({key[1] for key in ratio}, reverse=True)
    cases = [c for c in CASES if any(key[0] == c for key in ratio)]
    columns = [(d, direction) for d in dims for direction in ("fwd", "bwd")]
    names = {"fwd": "forward", "bwd": "backward"}
    lengths = [next((tokens(r["seqlen"]) for r in doc["results"] if "ratio_median" in r), "-") for doc in docs]
    lines = [f"| case ({' / '.join(lengths)}) | " + " | ".join(f"d = {d} {names[w]}" for d, w in columns) + " |",
             "|---" * (len(columns) + 1) + "|"]
    for case in cases:
        cells = []
        for d, direction in columns:
            values = [ratio.get((case, d, direction, i)) for i in range(len(docs))]
            cells.append("-" if all(x is None for x in values)
                         else " / ".join("-" if x is None else f"{x:.2f}" for x in values) + "x")
        lines.append(f"| {CASE_LABELS.get(case, case)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dims", default="128")
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--window-seqlen", type=int, default=16384)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--table", nargs="+", metavar="RESULT.json", default=None,
                    help="print the markdown table of these result files (values joined in this order) and exit")
    args = ap.parse_args(argv)
    if args.table:
        docs = []
        for path in args.table:
            with open(path) as f:
                docs.append(json.load(f))
        print(markdown_table(docs))
        return 0
    unknown = [c for c in filter(None, args.cases.split(",")) if c not in CASES]
    if unknown:
        raise SystemExit(f"--cases: unknown {', '.join(unknown)}; the cases are {', '.join(CASES)} (or \"\": none)")
    if not torch.cuda.is_available():
        print("bench_variants needs a CUDA GPU")
        return 2
    rng = random.Random(args.seed)
    impls = _impls()
    rows = []
    for d in (int(x) for x in args.dims.split(",")):
        for name in filter(None, args.cases.split(",")):
            rows += run_case(name, d, args.seqlen, args.rounds, rng, impls)
            if args.out:  # after every case: a long run that is cut short keeps what it measured
                write_results(args.out, "benchmarks.bench_variants", rows, args.rounds)
        if args.window_seqlen:
            rows += window_cost(d, args.window_seqlen, 1024, args.rounds, rng)
    if args.out:
        write_results(args.out, "benchmarks.bench_variants", rows, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
