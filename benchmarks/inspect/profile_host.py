"""Where the host time of one fa4 call goes: cProfile of forward and forward + backward calls.

    python -m benchmarks.inspect.profile_host [--calls 300] [--top 30]

The 1 x 128 x 4 x 128 causal bf16 problem of host_overhead (its tiny_problem; kernel time negligible); prints the
functions with the largest cumulative time, so a change to the launch path can be aimed.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("profile_host needs a CUDA GPU")
        return 2
    import fa4
    from .host_overhead import tiny_problem

    q, k, v, g = tiny_problem()

    def fwd():
        fa4.flash_attn_func(q, k, v, causal=True)

    def fwd_bwd():
        torch.autograd.grad(fa4.flash_attn_func(q, k, v, causal=True), (q, k, v), g)

    for name, fn in (("forward", fwd), ("forward + backward", fwd_bwd)):
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        print(f"==== {name}: {args.calls} calls")
        pstats.Stats(prof).sort_stats("cumulative").print_stats(args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
