"""Where an eager decode step's host time goes, one layer of fa4's call at a time.

    python -m benchmarks.inspect.decode_host_layers [--batch 8] [--keys 512] [--calls 2000] [--rounds 5]

One token, GQA 32 / 8, d = 128, bf16, a dense cache of `--keys` keys (few, so the GPU work per call is a few
us and the loop measures the host), launch plans off (FA4_PLANS=0: a cache that grows every step gets no
plan). Each row calls one layer of `fa4.flash_attn_with_kvcache`'s eager path directly with the arguments
the layer above passes it, so the differences between rows are what each layer adds:

* with_kvcache: the public call (argument checks, routing, the step);
* attention_with_cache: the routed step (mask, packing, split count, output views);
* fa4_split: the split launch and its merge;
* attention_split_forward: stage 3's split launch alone (its checks, outputs, launch);
* split kernel launch: the compiled split kernel called with ready arguments;
* combine_parts: the merge (checks, outputs, launch);
* torch.empty: one small allocation, for scale.

Rounds visit the rows in a fresh random order; us per call, median and range over rounds.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--keys", type=int, default=512)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("decode_host_layers needs a CUDA GPU")
        return 2
    import fa4
    from fa4 import _dispatch, _kvcache
    from stage3_fwd_kernel import split_combine
    from stage3_fwd_kernel.hopper import host

    from .host_overhead import decode_problem, plans_setting

    q, k, v, lens = decode_problem(args.batch, args.keys)  # (B, 1, Hq, D), (B, S, Hkv, D) x 2, (B,) int32
    (b, _, hq, d), s, hkv = q.shape, k.shape[1], k.shape[2]
    g = hq // hkv
    scale = d ** -0.5
    sm = _kvcache._sm_count(q.device)
    n = _kvcache.choose_num_splits(b, hkv * 1, s, sm)
    chunk, n = _kvcache.split_chunks(s, n)
    rows = q.view(b, 1, hkv, g, d).transpose(2, 3).reshape(b, g, hkv, d)                 # packed (B, g, Hkv, D)
    final = q.new_empty(b, 1, hq, d)
    into = final.view(b, hkv, g, d).transpose(1, 2)
    mod = _dispatch.backend_for(q.device).forward_module()
    tile_m = _dispatch.short_query_tile(g)
    lse_buf = torch.empty(hkv, b * n, g, device="cuda", dtype=torch.float32)
    parts, _ = mod.attention_split_forward(rows, k, v, n, chunk, seqused_k=lens, softmax_scale=scale,
                                           tile_m=tile_m, lse=lse_buf.permute(1, 0, 2))
    dt = host.host_io.cutlass_dtype(q.dtype)
    policy = host.make_policy(host.DEFAULT_RESCALE_THRESHOLD, host.DEFAULT_EMULATION_FRACTION, None)
    launch_args = host._call_args(rows, k, v, parts, lse_buf.permute(1, 0, 2), scale, g,
                                  seqused_k=lens, num_splits=n, chunk_keys=chunk,
                                  range_keys=host.RANGE_ALL)
    comp = host._compile(True, dt, d, d, False, policy, host.StaticTileScheduler,
                         host.varlen_flags(False, True, False, False), host._build_tile_m(
                             tile_m, d, d, False, host.PLAIN, True), key_split=True)

    cases = {
        "with_kvcache": lambda: fa4.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens),
        "attention_with_cache": lambda: _kvcache.attention_with_cache(
            q, k, v, lens, None, None, scale, False, (None, None), 0.0, None, 0, None, sm, _kvcache.fa4_varlen,
            False, _kvcache.fa4_split),
        "fa4_split": lambda: _kvcache.fa4_split(rows, k, v, lens, n, chunk, scale, 0.0, out=into),
        "attention_split_forward": lambda: mod.attention_split_forward(
            rows, k, v, n, chunk, seqused_k=lens, softmax_scale=scale, tile_m=tile_m, lse=lse_buf.permute(1, 0, 2)),
        "split kernel launch": lambda: comp.fn(*launch_args),
        "combine_parts": lambda: split_combine.combine_parts(parts, lse_buf, n, out=into),
        "torch.empty": lambda: torch.empty(b, hq, 1, device="cuda", dtype=torch.float32),
    }
    print(f"device {torch.cuda.get_device_name()}: q {tuple(q.shape)}, cache {tuple(k.shape)}, {n} splits of "
          f"{chunk} keys; {args.rounds} rounds of {args.calls} calls, plans off")
    times: dict = {name: [] for name in cases}
    rng = random.Random(0)
    with torch.no_grad(), plans_setting("0"):
        for fn in cases.values():
            for _ in range(50):
                fn()
        torch.cuda.synchronize()
        for _ in range(args.rounds):
            for name in rng.sample(list(cases), len(cases)):
                fn = cases[name]
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    fn()
                torch.cuda.synchronize()
                times[name].append(1e6 * (time.perf_counter() - t0) / args.calls)
    for name, ts in times.items():
        print(f"{name:26} {statistics.median(ts):7.1f} us/call (rounds {min(ts):.1f}-{max(ts):.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
