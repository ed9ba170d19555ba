"""Why is a backward step slower causal than non-causal per tile? Time one step on two grids.

    python benchmarks/probe_bwd_walk.py --out probe.json [--steps step1,step3_rs] [--dim 64] [--seqlen 8192]

* one wave: batch 1, one head -> seqlen / tile_n CTAs, fewer than the SMs. The kernel time is the
  longest CTA's walk (K/V tile 0 sees every Q tile, causal or not), so time / its tiles is the
  cost of one (K/V tile, Q tile) step with the GPU otherwise idle.
* full: the benchmark's grid (32k tokens, hidden 2048). Time / (all tile steps / SMs) is the cost
  per step if the steps were spread evenly over the SMs.

If causal and non-causal agree on one wave but not on the full grid, the difference is in how the
CTAs share the machine (waves, tails, L2), not in the per-tile code (masking). Timings include the
pre/postprocess kernels, as bench_bwd.py does.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_bwd import STEPS  # noqa: E402
from bench_fwd import timer, write_doc  # noqa: E402


def tile_steps(mod, d, causal, s, heads):
    """(steps of the longest CTA, steps over the whole grid) of one head-batch of length s."""
    from stage4_bwd_kernel import schedule

    tm, tn = mod.default_tiles(d, d)
    n_blocks = -(-s // tn)
    walks = []
    for n in range(n_blocks):
        lo, hi = schedule.m_block_range(n, tm, tn, s, s, causal)
        walks.append(max(hi - lo, 0))
    return max(walks), sum(walks) * heads


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", default="step1,step3_rs")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--grids", default="", help="extra grids BxH (batch x heads), e.g. '1x8,1x32'")
    ap.add_argument("--orders", default="", help="also time these dQ orders (schedule.py names), e.g. kv_descending")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_bwd_walk needs a CUDA GPU")
        return 2
    from stage3_fwd_kernel.hopper import attention_forward

    bench, timing = timer()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    d, s = args.dim, args.seqlen
    from stage4_bwd_kernel import schedule

    grids = [("one wave", (1, 1)), ("full", (32768 // s, 2048 // d))]
    grids += [(g, tuple(int(x) for x in g.split("x"))) for g in args.grids.split(",") if g]
    orders = {"default": None}
    orders.update({o: next(c for c in vars(schedule).values() if getattr(c, "name", None) == o)
                   for o in args.orders.split(",") if o})
    rows = []
    for name in args.steps.split(","):
        mod = importlib.import_module(STEPS[name])
        for grid, (b, h) in grids:
            for causal in (False, True):
                q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
                out, lse = attention_forward(q, k, v, causal=causal)
                for oname, order in orders.items():
                    ms = bench(lambda: mod.attention_backward(q, k, v, out, do, lse, causal=causal, dq_order=order))
                    longest, total = tile_steps(mod, d, causal, s, b * h)
                    waves = total / sms if grid != "one wave" else longest
                    per_step_us = 1e3 * ms / waves
                    rows.append(dict(step=name, grid=grid, order=oname, causal=causal, batch=b, heads=h, ms=ms,
                                     longest_walk=longest, total_steps=total, us_per_step=per_step_us))
                    print(f"{name:10} {grid:8} {oname:13} causal={causal!s:5} {ms:8.3f} ms  longest walk {longest:4}  "
                          f"all steps {total:7}  -> {per_step_us:6.2f} us per step", flush=True)
                del q, k, v, do, out, lse
    write_doc(args.out, "probe_bwd_walk.py", argv, rows, sms=sms, timing=timing, head_dim=d, seqlen=s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
