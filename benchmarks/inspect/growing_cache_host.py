"""Host time of decode steps over a cache that grows every step, layer by layer, and the plans they leave.

    python -m benchmarks.inspect.growing_cache_host [--steps 64] [--layers 32] [--rounds 3]
                                                    [--out benchmarks/results/growing_cache_host_h200.json]

transformers' DynamicCache hands each layer a cache one key longer than the step before, so every step
is a new launch-plan signature (fa4/_plans.py): the step's first layer takes the normal path, its second
records a plan (and writes it to disk), the later layers replay it. This times such steps:
`fa4.flash_attn_with_kvcache` on views ``buffer[:, :S0 + t]`` of one preallocated buffer (one token, GQA
32 / 8, d = 128, bf16, batch 1, S0 = 4096), `--layers` calls a step, `--steps` steps a round. Host clock,
synchronized per step (the GPU work is a few us a call). Variants, in paired rounds (a fresh random
order per round, each round on lengths no variant has seen):

* plans: the default;
* plans, kernel entries re-hashed: the same, with the per-process memo of each kernel's plan entry
  cleared before every step (what a recording cost before the memo: the kernel object verified and its
  library hashed once per plan);
* no plans: FA4_PLANS=0.

Reported per variant: us per step (median of rounds) and per layer, the recording call's time (layer 2),
and the plan directory's size after the run (`--keep N` runs it under FA4_PLANS_MAX = N, which prunes the
real plan directory: point FA4_CACHE_DIR at a copy to keep yours). `--profile TOP` then profiles the
recording calls of one more round of steps (cProfile, the TOP functions).
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

from .host_overhead import plans_setting

HEADS, KV_HEADS, HEAD_DIM, START = 32, 8, 128, 4096


def _steps(buffers, q, first_len, steps, layers, variant, profiler=None):
    """(us per step, us of each step's second call) over `steps` steps from first_len keys; a cProfile
    `profiler` is enabled around each step's second call (the recording one) only."""
    import torch

    import fa4
    from fa4 import _plans

    k_buf, v_buf = buffers
    per_step, recording = [], []
    with plans_setting("0" if variant == "no plans" else "1"):
        for t in range(steps):
            n = first_len + t
            k, v = k_buf[:, :n], v_buf[:, :n]
            lens = torch.full((1,), n, dtype=torch.int32, device="cuda")
            if variant.endswith("re-hashed"):
                _plans._ENTRIES.clear()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for layer in range(layers):
                if profiler is not None and layer == 1:
                    profiler.enable()
                t1 = time.perf_counter()
                fa4.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens)
                if profiler is not None and layer == 1:
                    profiler.disable()
                if layer == 1:
                    recording.append(1e6 * (time.perf_counter() - t1))
            torch.cuda.synchronize()
            per_step.append(1e6 * (time.perf_counter() - t0))
    return statistics.median(per_step), statistics.median(recording)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--keep", type=int, default=None,
                    help="FA4_PLANS_MAX for the run, to see the pruning (it prunes the real plan directory)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", type=int, default=0, metavar="TOP",
                    help="after the rounds, cProfile the recording calls of --steps more steps (plans on) and "
                         "print the TOP functions by own and by cumulative time")
    args = ap.parse_args(argv)
    for flag, value in (("--steps", args.steps), ("--layers", args.layers), ("--rounds", args.rounds),
                        ("--keep", 1 if args.keep is None else args.keep)):
        if value < (2 if flag == "--layers" else 1):
            raise SystemExit(f"{flag}: expected >= {2 if flag == '--layers' else 1}, got {value}")
    if args.profile < 0:
        raise SystemExit(f"--profile: expected >= 0 (0: no profile), got {args.profile}")
    import torch

    if not torch.cuda.is_available():
        print("growing_cache_host needs a CUDA GPU")
        return 2
    from fa4 import _plans

    if args.keep is not None:
        os.environ["FA4_PLANS_MAX"] = str(args.keep)
    variants = ["plans", "plans, kernel entries re-hashed", "no plans"]
    total = START + (args.rounds * len(variants) + 2) * args.steps + 1
    q = torch.randn(1, 1, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    buffers = tuple(torch.randn(1, total, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    next_len = START
    _steps(buffers, q, next_len, args.steps, args.layers, "plans")  # compiles, warms the allocator
    next_len += args.steps
    times: dict = {v: [] for v in variants}
    rng = random.Random(0)
    for r in range(args.rounds):
        for variant in rng.sample(variants, len(variants)):
            times[variant].append(_steps(buffers, q, next_len, args.steps, args.layers, variant))
            next_len += args.steps
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{v} {times[v][-1][0]:.0f} us" for v in variants),
              flush=True)
    on_disk = len(list(_plans.plan_dir("sm_90a").glob("*.json")))
    plan_stats = _plans.stats()  # before the profile's round, which records plans of its own
    rows = []
    for variant in variants:
        step = statistics.median(s for s, _ in times[variant])
        rec = statistics.median(c for _, c in times[variant])
        rows.append({"variant": variant, "us_per_step": step, "us_per_layer": step / args.layers,
                     "second_call_us": rec, "rounds": times[variant]})
        print(f"{variant:32} {step:9.0f} us / step  {step / args.layers:6.1f} us / layer  "
              f"second call {rec:7.0f} us")
    print(f"plans on disk after the run: {on_disk} (FA4_PLANS_MAX={_plans.max_on_disk()}); stats {plan_stats}")
    if args.profile:
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        _steps(buffers, q, next_len, args.steps, args.layers, "plans", profiler)
        for key in ("tottime", "cumulative"):
            print(f"---- the recording calls of {args.steps} steps, sorted by {key}")
            pstats.Stats(profiler).sort_stats(key).print_stats(args.profile)
    if args.out:
        from ..bench_fwd import write_doc

        write_doc(args.out, "benchmarks.inspect.growing_cache_host", argv, rows,
                  shapes=f"batch 1, {START}+ keys growing 1 a step, GQA {HEADS}/{KV_HEADS}, d={HEAD_DIM}, bf16, "
                         f"{args.layers} calls a step, {args.steps} steps a round",
                  plans_on_disk=on_disk, plans_max=_plans.max_on_disk(), plan_stats=plan_stats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
