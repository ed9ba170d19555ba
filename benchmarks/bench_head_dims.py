"""Head-dim pairs against the official FlashAttention-4, and what zero-padding costs.

    python -m benchmarks.bench_head_dims [--pairs 128/64,80,112] [--seqlen 8192] [--causal 0,1]
                                         [--rounds 5] [--out head_dims.json]

Each pair (qk/v; one number = both) runs through the public functions of both sides, forward and
backward (the backward timed on a retained graph), in paired rounds (benchmarks.ab_fwd). Pairs
without a kernel of their own run in fa4 on the native pair that covers them (fa4._layouts); for
those a third column, "fa4@native", times fa4 on inputs already padded to that pair, so
fa4 / fa4@native is the padding's cost (the copies of the inputs and of out), and official / fa4
the comparison users see. 32k tokens per call (batch = 32768 / seqlen), 16 query heads, bf16.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys

import torch

from .ab_fwd import paired_rounds, write_results
from .bench_variants import fwd_bwd_calls


def parse_pairs(text: str) -> list:
    pairs = []
    for item in text.split(","):
        d, _, dv = item.partition("/")
        pairs.append((int(d), int(dv or d)))
    return pairs


def run_pair(d, dv, seqlen, causal, rounds, rng):
    import fa4
    from fa4 import _layouts

    b, h = max(1, 32768 // seqlen), 16
    g = torch.Generator(device="cuda").manual_seed(d * 1000 + dv)

    def inputs(dq, dvv):
        make = lambda dim: torch.randn(b, seqlen, h, dim, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
        return [make(dq).requires_grad_(), make(dq).requires_grad_(), make(dvv).requires_grad_()]

    q, k, v = inputs(d, dv)
    native = _layouts.native_pair(_layouts.arch_of(q.device), d, dv)
    impls = {"fa4": (fa4.flash_attn_func, (q, k, v))}
    try:
        from flash_attn.cute.interface import flash_attn_func as official
        impls["official"] = (official, (q, k, v))
    except ImportError:
        pass
    if native != (d, dv):
        scale = d ** -0.5
        impls["fa4@native"] = (lambda *a, **kw: fa4.flash_attn_func(*a, softmax_scale=scale, **kw), inputs(*native))
    fns, outs, refused = {"fwd": {}, "bwd": {}}, {}, {}
    for name, (fn, args) in impls.items():
        try:
            f, bw, outs[name] = fwd_bwd_calls(fn, *args, causal, {})
            bw()
            fns["fwd"][name], fns["bwd"][name] = f, bw
        except Exception as err:  # noqa: BLE001 - a refusal is a result here
            refused[name] = f"{type(err).__name__}: {str(err)[:160]}"
    if "official" in outs and "fa4" in outs:
        err = (outs["fa4"].float() - outs["official"].float()).abs().max().item()
        if err > 0.05:
            raise SystemExit(f"({d}, {dv}) causal={causal}: fa4 and the official output differ by {err:.3g}")
    rows = []
    for direction in ("fwd", "bwd"):
        times = paired_rounds(fns[direction], rounds, rng)
        med = {n: statistics.median(t) for n, t in times.items()}
        row = {"head_dim": d, "head_dim_v": dv, "native": list(native), "causal": causal, "direction": direction,
               "seqlen": seqlen, "batch": b, "heads": h, "refused": refused, "ms_rounds": times, "ms_median": med}
        for other, key in (("official", "official_over_fa4"), ("fa4@native", "fa4_over_native")):
            if other in times and "fa4" in times:
                pairs = zip(times[other], times["fa4"])
                ratios = [o / f for o, f in pairs] if other == "official" else [f / o for o, f in pairs]
                row[key] = statistics.median(ratios)
        text = "  ".join(f"{n} {m:.3f} ms" for n, m in med.items())
        extra = "  ".join(f"{k} {row[k]:.3f}" for k in ("official_over_fa4", "fa4_over_native") if k in row)
        print(f"({d:3},{dv:3}) causal={int(causal)} {direction}: {text}  {extra}  refused: {sorted(refused)}",
              flush=True)
        rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", default="128/64,80,112,160/128")
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_head_dims needs a CUDA GPU")
        return 2
    rng = random.Random(args.seed)
    rows = []
    for d, dv in parse_pairs(args.pairs):
        for causal in (bool(int(c)) for c in args.causal.split(",")):
            rows += run_pair(d, dv, args.seqlen, causal, args.rounds, rng)
            if args.out:  # after every case: a run cut short keeps what it measured
                write_results(args.out, "benchmarks.bench_head_dims", rows, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
