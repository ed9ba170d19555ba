"""Where a backward's time goes, kernel by kernel: ours (a benchmarks.ab_bwd variant) next to the official FA4.

    python -m benchmarks.inspect.kernel_breakdown --dims 64,192x128 --seqlens 1024,4096 --causal 0,1 --out breakdown.json

Each case runs `--calls` backward calls under torch.profiler (CUDA activity only) and reports the mean device
time per call of every kernel launched, so a gap between the totals can be pinned on the preprocess, the
main kernel or the postprocess. Shapes as benchmarks.bench_bwd (bf16, 32k tokens per batch, hidden 2048). Kernel
times here are back to back (no L2 flush between calls), so they read slightly lower than do_bench's.
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict

import torch

from ..ab_bwd import backward_case, make_variant
from ..ab_fwd import head_dims
from ..bench_fwd import write_doc


def kernel_times(fn, calls: int) -> dict:
    """Mean device microseconds per call of each kernel name that fn launches."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    total = defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time > 0:
            total[ev.name] += ev.device_time
    return {name: us / calls for name, us in sorted(total.items(), key=lambda kv: -kv[1])}


def short(name: str, width: int = 60) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variant", default="production", help="our backward, a benchmarks.ab_bwd variant spec")
    ap.add_argument("--dims", default="64", help="head dims, d or dxdv (e.g. 64,192x128)")
    ap.add_argument("--seqlens", default="1024,4096")
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernel_breakdown needs a CUDA GPU")
        return 2
    ours = make_variant(args.variant)
    rows = []
    for d, dv in head_dims(args.dims):
        for causal in (bool(int(x)) for x in args.causal.split(",")):
            for s in (int(x) for x in args.seqlens.split(",")):
                b, h, inputs, peers = backward_case(d, dv, s, causal)
                cases = {"ours:" + args.variant: lambda: ours(*inputs, causal), "official": peers["official"]}
                for impl, fn in cases.items():
                    times = kernel_times(fn, args.calls)
                    rows.append({"impl": impl, "head_dim": d, "head_dim_v": dv, "causal": causal, "seqlen": s,
                                 "batch": b, "heads": h, "total_us": sum(times.values()), "kernels_us": times})
                    print(f"d={d}x{dv} causal={causal!s:5} s={s:5} {impl:24} total {sum(times.values()):9.1f} us",
                          flush=True)
                    for name, us in times.items():
                        print(f"      {us:9.1f} us  {short(name)}")
                del inputs, peers, cases
    if args.out:
        write_doc(args.out, "benchmarks.inspect.kernel_breakdown", argv, rows, calls=args.calls)
    return 0


if __name__ == "__main__":
    sys.exit(main())
