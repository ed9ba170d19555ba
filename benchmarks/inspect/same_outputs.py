"""Does a forward variant compute bitwise what the production forward computes? For changes that must not move a bit.

    python -m benchmarks.inspect.same_outputs my_variant [--against stage3_fwd_kernel.hopper]

A variant (an untracked copy of the production forward with its own STEP, as benchmarks.ab_fwd times
them; or the forward of an older commit copied the same way) that only moves
instructions -- packs before a wait, a different issue order -- must return the same out and lse bit for
bit. This runs both modules on odd shapes (seqlen 1, 113 x 203, 799 x 3, 239 x 1), fp16 and bf16, every
head dim, causal or not, one CTA per tile and persistent, and prints one line per case; exit status 1 if
any case differs. It checks no tolerance: a variant that changes the arithmetic belongs to the gpu tier.
"""
from __future__ import annotations

import argparse
import importlib
import sys

CASES = [  # (batch, seqlen_q, seqlen_k, heads, d, dv, causal, dtype name)
    (2, 113, 203, 4, 128, 128, True, "bfloat16"), (1, 799, 3, 2, 64, 64, False, "float16"),
    (2, 1024, 1024, 4, 192, 128, True, "bfloat16"), (1, 4224, 4224, 2, 128, 128, False, "float16"),
    (2, 239, 1, 2, 256, 256, True, "bfloat16"), (3, 1000, 1500, 4, 96, 96, True, "bfloat16"),
    (1, 2048, 2048, 8, 64, 64, True, "bfloat16"), (2, 1, 3, 2, 128, 128, True, "float16"),
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("variant", help="module path of the variant (its attention_forward(q, k, v, causal=, persistent=))")
    ap.add_argument("--against", default="stage3_fwd_kernel.hopper")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("same_outputs needs a CUDA GPU", file=sys.stderr)
        return 2
    base, var = (importlib.import_module(m) for m in (args.against, args.variant))
    torch.manual_seed(args.seed)
    bad = 0
    for b, sq, sk, h, d, dv, causal, dt in CASES:
        dtype = getattr(torch, dt)
        q = torch.randn(b, sq, h, d, device="cuda", dtype=dtype)                # (B, Sq, H, D)
        k = torch.randn(b, sk, h, d, device="cuda", dtype=dtype)                # (B, Sk, H, D)
        v = torch.randn(b, sk, h, dv, device="cuda", dtype=dtype)               # (B, Sk, H, Dv)
        out, lse = base.attention_forward(q, k, v, causal=causal)
        for persistent in (None, True) if max(d, dv) <= 128 else (None,):  # above 128: one CTA per tile
            out_v, lse_v = var.attention_forward(q, k, v, causal=causal, persistent=persistent)
            same = torch.equal(out, out_v) and torch.equal(lse, lse_v)
            bad += not same
            print(f"{'same' if same else 'DIFF'}  b={b} sq={sq} sk={sk} h={h} d={d}/{dv} causal={causal} {dt} "
                  f"persistent={persistent}  max|out diff|={(out.float() - out_v.float()).abs().max().item():.3g}",
                  flush=True)
    print(f"same_outputs: {'all cases bitwise equal' if not bad else f'{bad} case(s) differ'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
