"""Two builds of one paired run, compared round by round: is a change faster, and how reliably?

    python -m benchmarks.ab_pair ab.json my_copy stage3_fwd_kernel.hopper

`benchmarks.ab_fwd` and `benchmarks.ab_bwd` time every build in the same interleaved rounds and keep each
round's milliseconds (`ms_rounds`). Two medians taken apart hide how the rounds pair up: the GPU's clock
drifts between rounds (both kernels run at the GPU's power cap), and a build that is 1% faster
in every round can show a smaller or even reversed gap between medians. This takes, for every
case (head dims, mask, seqlen) both builds ran, the ratio time(B) / time(A) in each round (> 1: A
faster), and prints its median, how many rounds A won, and both builds' ratio to the official
kernel of the same run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys


def case_key(row: dict) -> tuple:
    return row["head_dim"], row.get("head_dim_v", row["head_dim"]), bool(row["causal"]), row["seqlen"]


def paired(doc: dict, a: str, b: str) -> list[dict]:
    """Per case both builds ran: the median of time(b) / time(a) over the rounds, rounds a won, the rounds,
    and each build's median ratio to the official kernel (ratio_median of the run)."""
    rows = {(r["impl"],) + case_key(r): r for r in doc["results"]}
    impls = {r["impl"] for r in doc["results"]}
    for name in (a, b):
        if name not in impls:
            raise ValueError(f"impl: {name!r} is not in this run; it has {sorted(impls)}")
    out = []
    for key in sorted({case_key(r) for r in doc["results"]}):
        ra, rb = rows.get((a,) + key), rows.get((b,) + key)
        if ra is None or rb is None:
            continue
        if len(ra["ms_rounds"]) != len(rb["ms_rounds"]):
            raise ValueError(f"ms_rounds: {a} and {b} ran a different number of rounds at {key}")
        ratios = [tb / ta for ta, tb in zip(ra["ms_rounds"], rb["ms_rounds"])]
        out.append({"head_dim": key[0], "head_dim_v": key[1], "causal": key[2], "seqlen": key[3],
                    "ratio": statistics.median(ratios), "wins": sum(x > 1 for x in ratios), "rounds": len(ratios),
                    "a_vs_official": ra.get("ratio_median"), "b_vs_official": rb.get("ratio_median")})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", help="a JSON file written by benchmarks.ab_fwd or benchmarks.ab_bwd")
    ap.add_argument("a", help="the build under test (its impl / variant name in the file)")
    ap.add_argument("b", help="the build it is compared with")
    args = ap.parse_args(argv)
    with open(args.results) as f:
        doc = json.load(f)
    try:
        rows = paired(doc, args.a, args.b)
    except ValueError as err:
        raise SystemExit(f"ab_pair: {err}")
    if not rows:
        raise SystemExit(f"ab_pair: {args.a} and {args.b} share no case in {args.results}")
    print(f"{args.results}: {doc.get('device', '?')}, commit {doc.get('git_commit', '?')}; "
          f"per round time({args.b}) / time({args.a}), > 1: {args.a} faster")
    for r in rows:
        dims = f"d={r['head_dim']}" + (f"/{r['head_dim_v']}" if r["head_dim_v"] != r["head_dim"] else "")
        vs = ""
        if r["a_vs_official"] is not None and r["b_vs_official"] is not None:
            vs = f"  vs official {r['a_vs_official']:.3f} / {r['b_vs_official']:.3f}"
        print(f"{dims:>10} {'causal' if r['causal'] else 'full':>6} {r['seqlen']:>6}: {r['ratio'] - 1:+.1%} "
              f"({r['wins']} of {r['rounds']} rounds faster){vs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
