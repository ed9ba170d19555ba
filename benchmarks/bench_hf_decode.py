"""A left-padded batch's decode step through the transformers integration: the cache read in place or gathered.

    python -m benchmarks.bench_hf_decode [--shapes 8x4096,8x16384,32x4096] [--rounds 5]
                                         [--out benchmarks/results/bench_hf_decode_h100.json]
    python -m benchmarks.bench_hf_decode --table RESULT.json      # fa4/README.md's table

One layer's attention of a decode step as transformers calls it (`fa4_attention_forward`): query
(B, 32, 1, 128), key / value (B, 8, S, 128) as its cache holds them, bf16, causal, and the step's 2-D
padding mask with each row's first pad_b keys padding (pad_b drawn from [0, S / 2)). Peers:

* in_place: the mask as fa4_mask returns it for left padding (a LeftPadding), so the call is
  flash_attn_with_kvcache with cache_leftpad on the cache as it is (the split launch);
* gather: the same mask as a plain tensor (what right padding or padding inside a row gets): the general padded
  path, which gathers every valid key and value into a packed copy and runs flash_attn_varlen_func;
* sdpa: torch SDPA on the same tensors with the boolean mask broadcast to (B, 1, 1, S) and enable_gqa
  (what attn_implementation="sdpa" runs; the backend is torch's choice);
* copy_k: a device copy of K (the bandwidth yardstick).

Each peer is timed twice in the same paired rounds (benchmarks.ab_fwd.paired_rounds): replayed from a
CUDA graph of 20 calls ("graph": device time), and called eagerly ("eager": what an eager generate()
loop sees, host time included). GB/s = bytes of Q and of the valid keys and values / time. Each
peer's output is checked against in_place's first.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys

import torch

from .ab_fwd import paired_rounds
from .bench_decode import CALLS_PER_GRAPH, _graphed, copy_peer, parse_shapes, printed_table
from .bench_fwd import write_doc

HQ, HKV, D = 32, 8, 128


def _layer_call(q, k, v, mask):
    """fa4_attention_forward as a decoder layer calls it (module: causal, scaling 1 / sqrt(d))."""
    from fa4.integrations.transformers import fa4_attention_forward

    module = torch.nn.Module()
    module.is_causal = True
    return lambda: fa4_attention_forward(module, q, k, v, mask, scaling=D ** -0.5)[0]


def _peers(q, k, v, mask):
    from fa4.integrations.transformers import LeftPadding, fa4_mask

    left = fa4_mask(q.shape[0], 1, k.shape[2], attention_mask=mask)
    assert isinstance(left, LeftPadding), "fa4_mask did not take the mask for left padding"
    plain = left.mask                               # the same values as a plain padding mask
    sdpa_mask = mask.bool()[:, None, None, :]       # (B, 1, 1, S)
    return {
        "in_place": _layer_call(q, k, v, left),
        "gather": _layer_call(q, k, v, plain),
        "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=sdpa_mask, enable_gqa=True, scale=D ** -0.5).transpose(1, 2),
        "copy_k": copy_peer(k),
    }


def run_shape(batch, cache, rounds, rng):
    g = torch.Generator(device="cuda").manual_seed(batch * 7 + cache)
    q = torch.randn(batch, HQ, 1, D, device="cuda", generator=g, dtype=torch.bfloat16)
    k, v = (torch.randn(batch, HKV, cache, D, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    pad = torch.randint(0, cache // 2, (batch,), device="cuda", generator=g)
    mask = (torch.arange(cache, device="cuda")[None, :] >= pad[:, None]).long()     # (B, S), zeros first
    peers = _peers(q, k, v, mask)
    want = peers["in_place"]()
    for name in ("gather", "sdpa"):
        err = (peers[name]().float() - want.float()).abs().max().item()
        assert err < 2e-2, f"{name} differs from in_place by {err}"
    timed = {}
    for name, fn in peers.items():
        graph, _ = _graphed(fn)
        timed[f"{name}/graph"] = lambda graph=graph: graph.replay()
        timed[f"{name}/eager"] = lambda fn=fn: [fn() for _ in range(CALLS_PER_GRAPH)]
    times = paired_rounds(timed, rounds, rng)
    valid = int(mask.sum())
    moved = q.numel() * 2 + valid * HKV * D * 2 * 2
    row = {"batch": batch, "cache": cache, "valid_keys": valid, "peers": {}}
    for name, ts in times.items():
        us = statistics.median(ts) * 1e3 / CALLS_PER_GRAPH
        gbs = (2 * k.numel() * 2 if name.startswith("copy_k") else moved) / (us * 1e-6) / 1e9
        row["peers"][name] = {"us": us, "gb_per_s": gbs, "rounds_ms": ts}
    for mode in ("graph", "eager"):
        base = times[f"in_place/{mode}"]
        for name in ("gather", "sdpa"):
            row["peers"][f"{name}/{mode}"]["over_in_place"] = statistics.median(
                o / i for o, i in zip(times[f"{name}/{mode}"], base))
    print(f"{batch} x {cache}: " + ", ".join(f"{n} {p['us']:.1f} us ({p['gb_per_s']:.0f} GB/s)"
                                            for n, p in row["peers"].items()), flush=True)
    return row


def markdown_table(doc) -> str:
    """fa4/README.md's table from a results file: us a call from the CUDA graphs, median of the rounds."""
    lines = ["| batch x cache | in place | gathered copy | torch SDPA |", "|---|---|---|---|"]
    for r in doc["results"]:
        cells = [f"{r['peers'][n + '/graph']['us']:.1f}" for n in ("in_place", "gather", "sdpa")]
        lines.append(f"| {r['batch']} x {r['cache'] // 1024}k | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if printed_table(argv, markdown_table):
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="8x4096,8x16384,32x4096", help="BATCHxCACHE,...")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    shapes = parse_shapes("--shapes", args.shapes)
    if not torch.cuda.is_available():
        print("bench_hf_decode needs a CUDA GPU")
        return 2
    rng = random.Random(0)
    rows = [run_shape(b, c, args.rounds, rng) for b, c in shapes]
    if args.out:
        write_doc(args.out, "benchmarks.bench_hf_decode", None, rows,
                  shapes=f"bf16, GQA {HQ}/{HKV}, d={D}, one causal query token, left padding of [0, S/2) keys",
                  method=f"CUDA graphs of {CALLS_PER_GRAPH} calls and {CALLS_PER_GRAPH} eager calls, "
                         f"{args.rounds} paired rounds (random order); GB/s = bytes of Q and the valid K, V / time")
    return 0


if __name__ == "__main__":
    sys.exit(main())
