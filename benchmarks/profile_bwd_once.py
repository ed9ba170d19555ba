"""Run one backward step once on a fixed grid (for Nsight Compute: ncu -k regex:... python this.py).

    ncu --section SpeedOfLight --section WarpStateStats python benchmarks/profile_bwd_once.py --causal
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_bwd import STEPS  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--step", default="step3_rs")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--causal", action="store_true")
    args = ap.parse_args(argv)
    from stage3_fwd_kernel.hopper import attention_forward

    mod = importlib.import_module(STEPS[args.step])
    b, s, h, d = args.batch, args.seqlen, args.heads, args.dim
    q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    out, lse = attention_forward(q, k, v, causal=args.causal)
    for _ in range(2):  # compile + one warm run; the profiler skips these launches
        mod.attention_backward(q, k, v, out, do, lse, causal=args.causal)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
