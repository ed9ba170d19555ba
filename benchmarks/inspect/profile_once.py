"""Run one forward or backward once on a fixed grid, ours or the official FA4's (for Nsight Compute).

    ncu --section SpeedOfLight --section WarpStateStats python -m benchmarks.inspect.profile_once --pass bwd --causal
    ncu -k regex:Sm90 ... python -m benchmarks.inspect.profile_once --pass fwd --impl official --dim 128 --seqlen 4096
    ncu -k regex:FlashAttentionForward ... python -m benchmarks.inspect.profile_once --pass fwd --impl fa4 --causal
        (the package's route: its tile order, e.g. LPT for long causal calls, and its persistent choice)
    ncu --section MemoryWorkloadAnalysis ... python -m benchmarks.inspect.profile_once --pass fwd --dim 128 \
        --fwd_kwargs persistent=False    (keyword arguments of our attention_forward, benchmarks.ab_fwd's syntax)

The first two calls (compile, warm-up) are made before the profiled one; ncu's --launch-skip can skip them.
With --section SourceCounters, `ncu -i rep.ncu-rep --page source --csv --print-source sass > rep.csv` then
`python -m benchmarks.inspect.ncu_stalls rep.csv` shows where the warps wait, instruction by instruction.
"""
from __future__ import annotations

import argparse
import importlib
import sys

import torch

from ..bench_bwd import STEPS


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pass", dest="which", choices=("fwd", "bwd"), default="bwd")
    ap.add_argument("--impl", default="ours",
                    help="'ours' (the production kernels' entry points), 'fa4' (the package's route) or 'official'")
    ap.add_argument("--step", default="production", help=f"our backward, of {', '.join(STEPS)} (--pass bwd --impl ours)")
    ap.add_argument("--variant", default=None,
                    help="instead of --step: a benchmarks.ab_bwd variant, e.g. step3_rs@64x128 (--pass bwd --impl ours)")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--dim_v", type=int, default=None, help="V's head dim (default --dim), e.g. --dim 192 --dim_v 128")
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--calls", type=int, default=3, help="calls in all (the last ones are the ones to profile)")
    ap.add_argument("--fwd_kwargs", default="",
                    help="keyword arguments of our forward (--pass fwd --impl ours), e.g. persistent=False~lpt_min=0")
    args = ap.parse_args(argv)
    if args.impl not in ("ours", "official", "fa4"):
        ap.error(f"--impl: expected 'ours', 'official' or 'fa4', got {args.impl!r}")
    if args.impl == "fa4" and args.which != "fwd":
        ap.error("--impl fa4: only with --pass fwd")
    if args.fwd_kwargs and (args.impl, args.which) != ("ours", "fwd"):
        ap.error("--fwd_kwargs: only with --pass fwd --impl ours")
    if args.step not in STEPS:
        ap.error(f"--step: expected one of {', '.join(STEPS)}, got {args.step!r}")
    from ..ab_fwd import parse_impl

    fwd_kwargs = parse_impl("ours~" + args.fwd_kwargs)[1] if args.fwd_kwargs else {}
    from stage3_fwd_kernel.hopper import attention_forward

    b, s, h, d = args.batch, args.seqlen, args.heads, args.dim
    dv = d if args.dim_v is None else args.dim_v
    q, k = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    v, do = (torch.randn(b, s, h, dv, device="cuda", dtype=torch.bfloat16) for _ in range(2))  # (B, S, H, Dv)
    if args.impl == "official":
        from flash_attn.cute.interface import flash_attn_func

        if args.which == "fwd":
            def call():
                flash_attn_func(q, k, v, causal=args.causal)
        else:
            qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
            o = flash_attn_func(qg, kg, vg, causal=args.causal)
            o = o[0] if isinstance(o, tuple) else o

            def call():
                torch.autograd.grad(o, (qg, kg, vg), do, retain_graph=True)
    elif args.impl == "fa4":
        import fa4  # the production route: LPT tile order for long causal calls, persistent CTAs where chosen

        def call():
            fa4.flash_attn_func(q, k, v, causal=args.causal)
    elif args.which == "fwd":
        def call():
            attention_forward(q, k, v, causal=args.causal, **fwd_kwargs)
    else:
        out, lse = attention_forward(q, k, v, causal=args.causal)
        if args.variant:
            from ..ab_bwd import make_variant

            variant = make_variant(args.variant)

            def call():
                variant(q, k, v, out, do, lse, args.causal)
        else:
            mod = importlib.import_module(STEPS[args.step])

            def call():
                mod.attention_backward(q, k, v, out, do, lse, causal=args.causal)
    for _ in range(args.calls):
        call()
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
