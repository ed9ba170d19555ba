"""The last partial wave of a persistent forward: how much of the call it costs, in paired rounds.

    python -m benchmarks.inspect.wave_tail [--dims 128] [--seqlens 4096,8192,16384] [--impls official,fa4] \\
        [--rounds 9] [--out wave_tail.json]

The benchmark's non-causal shapes (32k tokens, hidden 2048) give 4096 query tiles of 128 rows at
every length, 31.03 per SM on the H100's 132: 31 full waves and a 32nd in which 4 CTAs work and 128
SMs wait. A persistent kernel with equal tiles cannot finish before 32 tile-times, so up to 3% of
the call is that tail. To see it, each length is also timed with batch 1 and the head count that
makes the tiles an exact number of waves (33 heads at 16k: 4224 tiles = 32 x 132). If the tail costs
what the arithmetic says, the two shapes take the same time and the time per tile of the exact shape
is 4096 / 4224 of the benchmark's; `per_tile_ratio` (benchmark shape's time per tile over the exact
shape's, per round, median) is then ~1.03, and 1.0 if the last wave cost nothing.

Every round times every (implementation, shape) once in a fresh random order (benchmarks.ab_fwd's method).
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys

import torch

from stage3_fwd_kernel.hopper.config import default_tile_m

from ..ab_fwd import make_impl, paired_rounds, write_results


def exact_wave_heads(tiles_per_head: int, waves: int, sms: int) -> int | None:
    """Heads (batch 1) whose tiles fill `waves` waves of `sms` CTAs exactly, or None."""
    total = waves * sms
    return total // tiles_per_head if total % tiles_per_head == 0 else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dims", default="128", help="head dims (d = dv; d = 64 uses 192-row tiles)")
    ap.add_argument("--seqlens", default="4096,8192,16384")
    ap.add_argument("--impls", default="official,fa4")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("wave_tail needs a CUDA GPU")
        return 2
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    names = [n for n in args.impls.split(",") if n]
    impls = {n: make_impl(n) for n in names}
    rng = random.Random(args.seed)
    rows = []
    for d in (int(x) for x in args.dims.split(",")):
        tile_m = default_tile_m(d, d)  # both kernels' non-causal tile at these head dims
        for s in (int(x) for x in args.seqlens.split(",")):
            per_head = -(-s // tile_m)
            base = (32768 // s, 2048 // d)
            tiles = base[0] * base[1] * per_head
            waves = -(-tiles // sms)
            heads = exact_wave_heads(per_head, waves, sms)
            if heads is None:
                print(f"d={d} s={s}: no head count fills {waves} waves of {sms} with {per_head} tiles a head; skipped")
                continue
            shapes = {"benchmark": base, "exact_waves": (1, heads)}
            inputs = {}
            for label, (b, h) in shapes.items():
                qkv = [torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
                inputs[label] = (qkv, b * h * per_head)
            fns = {(n, label): (lambda n=n, qkv=qkv: impls[n](*qkv, False))
                   for n in names for label, (qkv, _) in inputs.items()}
            for fn in fns.values():
                fn()
            times = paired_rounds(fns, args.rounds, rng)
            for n in names:
                per_tile = {label: [t / inputs[label][1] for t in times[(n, label)]] for label in shapes}
                ratios = [a / e for a, e in zip(per_tile["benchmark"], per_tile["exact_waves"])]
                row = {"impl": n, "head_dim": d, "seqlen": s, "tile_m": tile_m, "sms": sms,
                       "benchmark_shape": list(base), "benchmark_tiles": tiles, "benchmark_waves": tiles / sms,
                       "exact_shape": [1, heads], "exact_tiles": inputs["exact_waves"][1],
                       "ms_benchmark": times[(n, "benchmark")], "ms_exact": times[(n, "exact_waves")],
                       "per_tile_ratio_median": statistics.median(ratios),
                       "per_tile_ratio_min": min(ratios), "per_tile_ratio_max": max(ratios),
                       "ideal_if_tail_is_idle": inputs["exact_waves"][1] / tiles}
                rows.append(row)
                print(f"d={d} s={s:5} {n:8} {tiles} tiles ({tiles / sms:.2f} waves) vs {row['exact_tiles']}: "
                      f"time per tile x{row['per_tile_ratio_median']:.3f} [{min(ratios):.3f}, {max(ratios):.3f}] "
                      f"(idle last wave: x{row['ideal_if_tail_is_idle']:.3f}; ms {statistics.median(row['ms_benchmark']):.3f}"
                      f" / {statistics.median(row['ms_exact']):.3f})", flush=True)
            del inputs, fns
    if args.out:
        write_results(args.out, "benchmarks.inspect.wave_tail", rows, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
