"""Where a left-padded generate() step's time goes, fa4 against torch SDPA: device kernels and host functions.

    python -m benchmarks.inspect.profile_generate [--batch 8] [--prompt 4096] [--new 16] [--layers 4]
                                                  [--peers fa4,sdpa] [--top 25] [--out F]

The model and prompts of benchmarks.bench_hf_generate. For each peer (an attn_implementation), after a
warm-up: the wall time per new token (the median of 3); the device time per new token, per kernel, from
torch.profiler over generate(new + 1) minus generate(1); the host-device calls per token (the waits,
cudaStreamSynchronize and the like, and cudaMemcpyAsync); the garbage collector's time; and cProfile of the
host functions over generate(new + 1). A step whose wall time is far above its device time is host-bound, so
the host tables say where to look.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys

# the host waiting on the device, and cudaMemcpyAsync apart (a read of a value makes one and a wait)
HOST_DEVICE_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpyAsync")


def _device_profile(run, tokens):
    """({kernel: device us}, {host-device call: count}) over run(tokens): the device-side events only, so an op and
    the kernels it launched are not both counted."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run(tokens)
    kernels, syncs = {}, {}
    for e in prof.key_averages():
        if e.device_type == DeviceType.CUDA and not e.is_user_annotation:  # annotations span kernels
            kernels[e.key] = kernels.get(e.key, 0.0) + e.self_device_time_total
        elif e.key in HOST_DEVICE_CALLS:
            syncs[e.key] = syncs.get(e.key, 0) + e.count
    return kernels, syncs


def _gc_ms(run, tokens) -> tuple[float, int]:
    """(ms spent in the garbage collector, collections) over run(tokens)."""
    from ..bench_hf_generate import collector_time

    with collector_time() as spent:
        run(tokens)
    return spent[0], spent[1]


def main(argv=None) -> int:
    from ..bench_hf_generate import add_model_arguments, check_counts, generate_s, model_and_prompts, model_shapes

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_arguments(ap, new=16)
    ap.add_argument("--peers", default="fa4,sdpa")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default=None, help="a results JSON: each peer's times, calls and top kernels")
    args = ap.parse_args(argv)
    check_counts(ap, args, "top")
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    if not peers:
        ap.error("--peers: name at least one attn_implementation (fa4, sdpa, eager, ...)")
    import torch

    if not torch.cuda.is_available():
        print("profile_generate needs a CUDA GPU", file=sys.stderr)
        return 2
    model, ids, mask = model_and_prompts(args.layers, args.batch, args.prompt)
    summary = []
    for impl in peers:
        def run(tokens, impl=impl):
            return generate_s(model, impl, ids, mask, tokens)

        run(args.new + 1)  # warm-up: compiles, allocator, launch plans
        walls = [1e3 * (run(args.new + 1) - run(1)) / args.new for _ in range(3)]
        wall_ms = statistics.median(walls)
        full, syncs_full = _device_profile(run, args.new + 1)
        one, syncs_one = _device_profile(run, 1)
        # a kernel of either run (one seen in generate(1) only counts negative); noise can leave a row < 0
        per_token = {k: (full.get(k, 0.0) - one.get(k, 0.0)) / args.new for k in full.keys() | one.keys()}
        device_ms = 1e-3 * (sum(full.values()) - sum(one.values())) / args.new
        syncs = {k: (syncs_full.get(k, 0) - syncs_one.get(k, 0)) / args.new for k in syncs_full.keys() | syncs_one}
        gc_ms, collections = _gc_ms(run, args.new + 1)
        top = sorted(per_token.items(), key=lambda kv: -kv[1])[:args.top]
        summary.append({"peer": impl, "wall_ms_per_token": wall_ms, "wall_rounds_ms": walls,
                        "device_ms_per_token": device_ms, "host_device_calls_per_token": syncs,
                        "gc_ms": gc_ms, "gc_collections": collections,
                        "top_kernels_us_per_token": [[name, us] for name, us in top]})
        print(f"==== {impl}: wall {wall_ms:.2f} ms / token, device {device_ms:.2f} ms / token, "
              f"host-device calls per token {syncs}, garbage collector {gc_ms:.1f} ms in {collections} "
              f"collections over generate({args.new + 1})", flush=True)
        print("---- kernels per new token, device us")
        for name, us in top:
            print(f"{us:10.1f}  {name[:110]}")
        prof = cProfile.Profile()
        prof.enable()
        run(args.new + 1)
        prof.disable()
        for key in ("tottime", "cumulative"):
            print(f"---- host functions over generate({args.new + 1}), sorted by {key}")
            pstats.Stats(prof).sort_stats(key).print_stats(args.top)
    for r in summary:
        print(f"{r['peer']:8} wall {r['wall_ms_per_token']:7.2f} ms / token  device {r['device_ms_per_token']:6.2f} "
              f"ms / token  calls {r['host_device_calls_per_token']}  gc {r['gc_ms']:.1f} ms ({r['gc_collections']})")
    if args.out:
        from ..bench_fwd import write_doc

        write_doc(args.out, "benchmarks.inspect.profile_generate", argv, summary,
                  shapes=model_shapes(args),
                  method="wall: median of 3 (t(new + 1) - t(1)) / new; device: torch.profiler kernels over "
                         "generate(new + 1) minus generate(1), per new token")
    return 0


if __name__ == "__main__":
    sys.exit(main())
