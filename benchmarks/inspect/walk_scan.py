"""Main-kernel time against walk length: a backward's fixed cost per CTA and its cost per Q tile.

    python -m benchmarks.inspect.walk_scan --variants production,step3_rs --dim 64 --out walk.json

One batch, seqlen_k = 4096 (32 K/V tiles of 128 keys per head), seqlen_q from 128 up: every CTA walks
seqlen_q / tile_m Q tiles. With 4 heads the grid is 128 CTAs, one wave, started together, so the CTAs
of a head walk the same Q tiles in lockstep (the worst case for adds into one dQ tile); with 33 heads
it is 8 waves. The main kernel's device time (torch.profiler, median of 3 x 20 calls) of each variant
(``benchmarks.ab_bwd`` specs, non-causal) and of the official FA4 is printed and written to --out: the slope
over seqlen_q is the cost per tile, the intercept the cost per CTA.
"""
from __future__ import annotations

import argparse
import sys

import torch

from ..ab_bwd import make_variant
from ..bench_fwd import write_doc
from .kernel_breakdown import kernel_times

SEQLEN_K = 4096


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", default="production", help="comma-separated benchmarks.ab_bwd variant specs")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--seqlens-q", default="128,256,512,1024,2048,4096")
    ap.add_argument("--heads", default="4,33", help="4: one wave of 128 CTAs; 33: eight waves")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("walk_scan needs a CUDA GPU")
        return 2
    from flash_attn.cute.interface import flash_attn_func as fa4_func

    from stage3_fwd_kernel.hopper import attention_forward

    ours = {v: make_variant(v) for v in args.variants.split(",") if v}
    d, rows = args.dim, []
    for heads in (int(x) for x in args.heads.split(",")):
        for sq in (int(x) for x in args.seqlens_q.split(",")):
            q, do = (torch.randn(1, sq, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            k, v = (torch.randn(1, SEQLEN_K, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            out, lse = attention_forward(q, k, v, causal=False)
            qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
            o = fa4_func(qg, kg, vg, causal=False)
            o = o[0] if isinstance(o, tuple) else o
            fns = {name: (lambda f=f: f(q, k, v, out, do, lse, False)) for name, f in ours.items()}
            fns["official"] = lambda: torch.autograd.grad(o, (qg, kg, vg), do, retain_graph=True)
            times = {name: [] for name in fns}
            for _ in range(3):
                for name, fn in fns.items():
                    times[name].append(max(kernel_times(fn, 20).values()))  # the main kernel is the longest
            row = {"head_dim": d, "heads": heads, "ctas": heads * SEQLEN_K // 128, "seqlen_q": sq,
                   "seqlen_k": SEQLEN_K, "main_kernel_us": {n: sorted(t)[1] for n, t in times.items()}}
            rows.append(row)
            print(f"d={d} heads={heads:3} CTAs={row['ctas']:5} seqlen_q={sq:5}  "
                  + "  ".join(f"{n} {us:7.1f} us" for n, us in row["main_kernel_us"].items()), flush=True)
    if args.out:
        write_doc(args.out, "benchmarks.inspect.walk_scan", argv, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
