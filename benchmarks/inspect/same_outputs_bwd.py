"""Does a backward variant compute bitwise what the production backward computes? same_outputs for the backward.

    python -m benchmarks.inspect.same_outputs_bwd my_copy_module [--against production]

Variants are ``benchmarks.ab_bwd``'s specs (``name[@MxN][:order][~keyword=int...][+det]``, a name of
bench_bwd.STEPS or a module path). A variant that only changes how values move (a store instruction, an
issue order) must return the same dq, dk and dv bit for bit: this runs both on odd shapes (seqlen 1,
113 x 203, 799 x 3), GQA, head dims 64, 96 and 128, causal or not, and prints one line per case; exit status 1 if any case differs. No tolerance is checked here:
a variant that changes the arithmetic belongs to the gpu tier. The default mode adds dQ with atomics
in no fixed order, so its dq is compared only when both specs end in ``+det``.
"""
from __future__ import annotations

import argparse
import sys

CASES = [  # (batch, seqlen_q, seqlen_k, heads_q, heads_kv, d, causal)
    (2, 113, 203, 4, 4, 128, True), (1, 799, 3, 2, 2, 64, False), (2, 1024, 1024, 4, 2, 128, False),
    (1, 4224, 4224, 2, 2, 128, True), (2, 1, 3, 2, 1, 64, True), (3, 1000, 1500, 4, 4, 96, True),
    (1, 2048, 2048, 8, 1, 64, True), (2, 4096, 4096, 2, 2, 128, True),
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("variant", help="a benchmarks.ab_bwd variant spec, e.g. my_copy_module+det")
    ap.add_argument("--against", default="production")
    ap.add_argument("--dims", default=None, help="only the cases of these head dims, e.g. 128 (default: all)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("same_outputs_bwd needs a CUDA GPU", file=sys.stderr)
        return 2
    from ..ab_bwd import make_variant
    from stage3_fwd_kernel.hopper import attention_forward

    base, var = make_variant(args.against), make_variant(args.variant)
    compare_dq = args.variant.endswith("+det") and args.against.endswith("+det")
    dims = None if args.dims is None else {int(x) for x in args.dims.split(",")}
    cases = [c for c in CASES if dims is None or c[5] in dims]
    torch.manual_seed(args.seed)
    bad = 0
    for b, sq, sk, hq, hkv, d, causal in cases:
        q, do = (torch.randn(b, sq, hq, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        k, v = (torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        out, lse = attention_forward(q, k, v, causal=causal)
        got = [var(q, k, v, out, do, lse, causal) for _ in range(2)]
        ref = base(q, k, v, out, do, lse, causal)
        names = ("dq", "dk", "dv")[0 if compare_dq else 1:]
        pairs = list(zip(ref, got[0], got[1]))[0 if compare_dq else 1:]
        same = [torch.equal(r, g0) and torch.equal(r, g1) for r, g0, g1 in pairs]
        dq_err = (got[0][0].float() - ref[0].float()).abs().max().item()
        bad += not all(same)
        print(f"{'same' if all(same) else 'DIFF'}  b={b} {sq}x{sk} heads {hq}/{hkv} d={d} causal={causal}: "
              + " ".join(f"{n}={'=' if s else 'x'}" for n, s in zip(names, same)) + f"  max|dq diff|={dq_err:.3g}",
              flush=True)
    print(f"{len(cases) - bad} of {len(cases)} cases bitwise equal")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
