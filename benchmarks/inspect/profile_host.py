"""Where the host time of one fa4 call goes: cProfile of forward and forward + backward calls.

    python -m benchmarks.inspect.profile_host [--calls 300] [--top 30]

The 1 x 128 x 4 x 128 causal bf16 problem of host_overhead (its tiny_problem; kernel time negligible) and its
decode step (decode_problem, through flash_attn_with_kvcache); prints the
functions with the largest cumulative time, so a change to the launch path can be aimed.
decode-no-plan: the same step with launch plans off (FA4_PLANS=0), what a cache that grows every step
gets (its shapes are new each call, so no plan replays); hf-left-padded: that step through the
transformers integration's left-padded path (fa4_attention_forward, a LeftPadding), plans off too.
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
    ap.add_argument("--cases", default="forward,forward+backward,decode",
                    help="comma-separated: forward, forward+backward, decode (flash_attn_with_kvcache, one token), "
                         "decode-no-plan, hf-left-padded")
    ap.add_argument("--sort", default="cumulative", help="pstats sort keys, comma-separated (e.g. cumulative,tottime)")
    ap.add_argument("--decode-batch", type=int, default=None, help="the decode cases' batch (host_overhead's default)")
    ap.add_argument("--decode-keys", type=int, default=None, help="the decode cases' cache keys")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("profile_host needs a CUDA GPU")
        return 2
    import fa4
    from .host_overhead import decode_problem, hf_left_padded_decode, tiny_problem, without_plans

    q, k, v, g = tiny_problem()
    dq, dk, dv, dlens = decode_problem(args.decode_batch, args.decode_keys)

    def fwd():
        fa4.flash_attn_func(q, k, v, causal=True)

    def fwd_bwd():
        torch.autograd.grad(fa4.flash_attn_func(q, k, v, causal=True), (q, k, v), g)

    def decode():
        fa4.flash_attn_with_kvcache(dq, dk, dv, cache_seqlens=dlens)

    known = {"forward": fwd, "forward+backward": fwd_bwd, "decode": decode, "decode-no-plan": without_plans(decode),
             "hf-left-padded": without_plans(hf_left_padded_decode(dq, dk, dv))}
    names = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in names if c not in known]
    if unknown:
        ap.error(f"--cases: unknown {unknown}; choose from {sorted(known)}")
    for name in names:
        fn = known[name]
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
        for key in args.sort.split(","):
            print(f"---- sorted by {key}")
            pstats.Stats(prof).sort_stats(key).print_stats(args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
