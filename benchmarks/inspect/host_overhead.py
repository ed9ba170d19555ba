"""Host (CPU) time per call of fa4 and its peers, on a problem too small for the GPU to matter.

    python -m benchmarks.inspect.host_overhead [--out benchmarks/results/host_overhead_h200.json]
                                               [--only decode] [--decode-batch 8] [--decode-keys 4096]

A 1 x 128 x 4 x 128 causal bf16 problem (and a decode step: one token, GQA 32 / 8, d = 128, a
16k-key dense cache, DECODE_SHAPE); per case, 200 calls back to back timed on the host clock,
in 7 rounds that visit the cases in a fresh random order (the host's speed drifts by tens of
percent between processes and over time, so only same-round comparisons mean much). The GPU work
per call is a few microseconds -- each row also reports it alone, from a CUDA-graph replay -- so
the loop measures what Python and the launch path cost.
Rows: fa4 forward, the production kernel's own entry point (``stage3_fwd_kernel.hopper``, fa4's
wrapper excluded), the official flash-attn-4 forward, and forward + backward of fa4, the official
kernel and torch SDPA; the decode step through fa4.flash_attn_with_kvcache, fa4.flash_attn_func and
the official flash_attn_func, and with launch plans off (FA4_PLANS=0: what a cache growing every step
gets, its shapes new each call), through the transformers integration's left-padded path, and torch
SDPA's decode (`enable_gqa`, no mask). `--decode-batch` / `--decode-keys` change the decode cases' problem,
`--only TEXT` keeps the cases whose name contains TEXT. The fa4 README's "Host overhead" numbers come from
this script.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import time


SHAPE = (1, 128, 4, 128)  # batch, seqlen, heads, head_dim: a few us of GPU work per call


def tiny_problem():
    """q, k, v (requiring grad) and an output gradient of shape SHAPE, bf16 on the GPU."""
    import torch

    q, k, v = (torch.randn(*SHAPE, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    return q, k, v, torch.randn(*SHAPE, device="cuda", dtype=torch.bfloat16)


DECODE_SHAPE = (1, 16384, 32, 8, 128)  # batch, cache keys, query heads, KV heads, head dim: one token


def decode_problem(batch: int | None = None, keys: int | None = None):
    """q (B, 1, Hq, D), a full dense cache k / v (B, S, Hkv, D) and cache_seqlens (B,) int32, bf16: DECODE_SHAPE,
    or its batch / cache keys replaced by `batch` / `keys`."""
    import torch

    b, s, hq, hkv, d = DECODE_SHAPE
    b, s = batch or b, keys or s
    q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return q, k, v, torch.full((b,), s, dtype=torch.int32, device="cuda")


@contextlib.contextmanager
def plans_setting(value: str):
    """FA4_PLANS set to `value` ("0" off, "1" on) inside the block (fa4 reads it per call), restored after."""
    saved = os.environ.get("FA4_PLANS")
    os.environ["FA4_PLANS"] = value
    try:
        yield
    finally:
        if saved is None:
            del os.environ["FA4_PLANS"]
        else:
            os.environ["FA4_PLANS"] = saved


def without_plans(fn):
    """fn with fa4's launch plans off (FA4_PLANS=0): what a call whose shapes are new each time gets --
    a decode step over a cache that grows every step."""
    def run():
        with plans_setting("0"):
            return fn()
    return run


def hf_left_padded_decode(q, k, v):
    """One layer's decode step through the transformers integration (fa4_attention_forward): the decode
    problem's tensors as transformers' (B, H, S, D) views and a left-padded mask (a quarter of each row's
    keys padding) that fa4_mask made a LeftPadding, so the step is flash_attn_with_kvcache with cache_leftpad."""
    import torch

    from fa4.integrations.transformers import fa4_attention_forward, fa4_mask

    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    b, s = k.shape[0], k.shape[1]
    mask = fa4_mask(b, 1, s, attention_mask=(torch.arange(s, device=q.device) >= s // 4).expand(b, s).long())
    module = torch.nn.Module()
    module.is_causal = True
    return lambda: fa4_attention_forward(module, qt, kt, vt, mask, scaling=q.shape[-1] ** -0.5)


def gpu_time_us(fn, replays: int = 200):
    """The GPU time of one call, without its host work: the call captured once in a CUDA graph and
    replayed back to back. None where capture fails. (A host loop of many calls can be GPU-bound
    too once the launch queue fills; this says which side sets the pace.)"""
    import torch

    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # warm-up on the capture stream
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        return 1e3 * start.elapsed_time(end) / replays
    except Exception as exc:  # noqa: BLE001 (a peer that cannot be captured is reported, not fatal)
        print(f"  (no CUDA-graph time: {type(exc).__name__}: {str(exc)[:120]})")
        return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument("--calls", type=int, default=200, help="calls per case and round")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--decode-batch", type=int, default=None,
                    help=f"the decode cases' batch (default {DECODE_SHAPE[0]})")
    ap.add_argument("--decode-keys", type=int, default=None,
                    help=f"the decode cases' cache keys (default {DECODE_SHAPE[1]})")
    ap.add_argument("--only", default=None, help="run the cases whose name contains this text (e.g. decode)")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("host_overhead needs a CUDA GPU")
        return 2
    import fa4
    from flash_attn.cute.interface import flash_attn_func as official
    from stage3_fwd_kernel import hopper as stage3

    b, s, h, d = SHAPE
    q, k, v, g = tiny_problem()

    def first(o):
        return o[0] if isinstance(o, tuple) else o

    def fwd_bwd(attn):
        def run():
            torch.autograd.grad(first(attn()), (q, k, v), g)
        return run

    def sdpa():
        o = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                             is_causal=True)
        torch.autograd.grad(o, (q, k, v), g.transpose(1, 2))

    dq, dk, dv, dlens = decode_problem(args.decode_batch, args.decode_keys)

    def sdpa_decode():
        # the cache is full, so no mask: one token sees every key
        return torch.nn.functional.scaled_dot_product_attention(dq.transpose(1, 2), dk.transpose(1, 2),
                                                                dv.transpose(1, 2), enable_gqa=True)

    cases = [("fa4 forward", lambda: fa4.flash_attn_func(q, k, v, causal=True)),
             ("stage3 attention_forward", lambda: stage3.attention_forward(q.detach(), k.detach(), v.detach(),
                                                                          causal=True)),
             ("official forward", lambda: official(q, k, v, causal=True)),
             ("fa4 forward + backward", fwd_bwd(lambda: fa4.flash_attn_func(q, k, v, causal=True))),
             ("official forward + backward", fwd_bwd(lambda: official(q, k, v, causal=True))),
             ("torch SDPA forward + backward", sdpa),
             ("fa4 decode with_kvcache", lambda: fa4.flash_attn_with_kvcache(dq, dk, dv, cache_seqlens=dlens)),
             ("fa4 decode flash_attn_func", lambda: fa4.flash_attn_func(dq, dk, dv)),
             ("official decode flash_attn_func", lambda: official(dq, dk, dv)),
             ("fa4 decode with_kvcache, no plans", without_plans(
                 lambda: fa4.flash_attn_with_kvcache(dq, dk, dv, cache_seqlens=dlens))),
             ("transformers left-padded decode", hf_left_padded_decode(dq, dk, dv)),
             ("transformers left-padded, no plans", without_plans(hf_left_padded_decode(dq, dk, dv))),
             ("torch SDPA decode", sdpa_decode)]
    if args.only:
        cases = [c for c in cases if args.only in c[0]]
        if not cases:
            ap.error(f"--only: no case name contains {args.only!r}")
    print(f"device {torch.cuda.get_device_name()}, {b}x{s}x{h}x{d} bf16 causal, decode {tuple(dq.shape)} q against "
          f"{tuple(dk.shape)} caches, {args.rounds} rounds of "
          f"{args.calls} calls per case, cases in a fresh random order each round")
    for _, fn in cases:  # compile + warm up
        for _ in range(20):
            fn()
    torch.cuda.synchronize()
    per_round: dict = {name: [] for name, _ in cases}
    rng = random.Random(0)
    for _ in range(args.rounds):
        for name, fn in rng.sample(cases, len(cases)):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.calls):
                fn()
            torch.cuda.synchronize()  # the GPU work (a few us per call) is part of the time
            per_round[name].append(1e6 * (time.perf_counter() - t0) / args.calls)
    rows = []
    for name, fn in cases:
        times = per_round[name]
        rows.append({"case": name, "us_per_call_median": statistics.median(times), "us_per_call_rounds": times,
                     "gpu_us_per_call": gpu_time_us(fn)})
        gpu = rows[-1]["gpu_us_per_call"]
        print(f"{name:30} {rows[-1]['us_per_call_median']:8.1f} us/call (median; rounds {min(times):.0f}-"
              f"{max(times):.0f})   GPU alone (graph replay) {'n/a' if gpu is None else f'{gpu:6.1f}'} us/call")
    if args.out:
        from ..bench_fwd import source_commit, source_digest, versions

        doc = {"device": torch.cuda.get_device_name(), "problem": f"{b}x{s}x{h}x{d} bf16 causal",
               "decode_q": list(dq.shape), "decode_cache": list(dk.shape),
               "calls": args.calls, "rounds": args.rounds, "versions": versions(), "git_commit": source_commit(),
               "source_digest": source_digest(),
               "command": "python -m benchmarks.inspect.host_overhead " + " ".join(argv if argv is not None else sys.argv[1:]),
               "rows": rows}
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
