"""Where a kernel's warps wait: Nsight Compute's per-instruction stall samples, summarised.

    ncu -k regex:BackwardSm90 --launch-skip 2 --launch-count 1 --section SourceCounters \\
        --section WarpStateStats -o rep python -m benchmarks.inspect.profile_once --pass bwd --dim 128
    ncu -i rep.ncu-rep --page source --csv --print-source sass > rep_sass.csv
    python -m benchmarks.inspect.ncu_stalls rep_sass.csv [--top 25] [--hot 0.8]

Prints (1) the share of every stall reason over all samples, (2) the instructions that collect
the most samples with their two main reasons, and (3) the hot loop (instructions executed between
--hot and 1 / --hot times as often as the busiest wgmma; spin-wait loops run far more often) as phases: the cumulative share at each barrier, wgmma,
wgmma wait and mbarrier instruction, so a person sees which stretch of a tile costs what.

A stalled warp's samples land on the instruction it waits to issue: time spent in a BAR.SYNC
shows up on the instruction after it, a wgmma wait on the WARPGROUP.DEPBAR itself. Samples come
from every warp, so producer and writer warps that idle by design are in the totals too.
"""
from __future__ import annotations

import argparse
import csv
import sys
from collections import Counter

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
MARKERS = ("BAR.", "HGMMA", "DEPBAR", "SYNCS", "FENCE", "MEMBAR", "UTMA", "UBLKRED")


def load(path: str) -> tuple[list[str], list[dict]]:
    """Header and rows of an `ncu --page source --csv --print-source sass` export (its preamble skipped)."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    try:
        start = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    except StopIteration:
        raise ValueError(f"{path}: no 'Address' header; expected ncu --page source --csv --print-source sass") from None
    header = rows[start]
    if SAMPLES not in header:
        raise ValueError(f"{path}: no '{SAMPLES}' column; profile with --section SourceCounters")
    return header, [dict(zip(header, r)) for r in rows[start + 1:] if len(r) == len(header)]


def _int(row: dict, key: str) -> int:
    value = row.get(key, "") or "0"
    return int(float(value))


def stall_columns(header: list[str]) -> list[str]:
    return [h for h in header if h.startswith("stall_") and "Not Issued" not in h]


def reason_shares(header: list[str], rows: list[dict]) -> dict[str, float]:
    """Stall reason -> fraction of all samples, largest first."""
    totals = Counter()
    for row in rows:
        for col in stall_columns(header):
            totals[col[len("stall_"):]] += _int(row, col)
    total = sum(totals.values()) or 1
    return {reason: n / total for reason, n in totals.most_common()}


def top_instructions(header: list[str], rows: list[dict], n: int) -> list[tuple[float, str, str, list]]:
    """(share of samples, address, SASS, [(reason, samples), (reason, samples)]) for the n most-sampled instructions."""
    total = sum(_int(r, SAMPLES) for r in rows) or 1
    cols = stall_columns(header)
    out = []
    for row in sorted(rows, key=lambda r: -_int(r, SAMPLES))[:n]:
        reasons = sorted(((c[len("stall_"):], _int(row, c)) for c in cols), key=lambda x: -x[1])[:2]
        out.append((_int(row, SAMPLES) / total, row["Address"], row["Source"].strip(), [x for x in reasons if x[1]]))
    return out


def hot_loop_phases(rows: list[dict], hot: float) -> list[tuple[float, float, str, str]]:
    """(cumulative share, share since the previous marker, address, SASS) at every marker instruction
    of the hot loop, in address order; shares are of all samples. A run of wgmma instructions is one
    marker (its last instruction, labelled with the count)."""
    total = sum(_int(r, SAMPLES) for r in rows) or 1
    # the reference count is the most-executed wgmma's: spin-wait loops execute far more often
    mma = [_int(r, EXECUTED) for r in rows if "HGMMA" in r["Source"]]
    most = max(mma) if mma else max((_int(r, EXECUTED) for r in rows), default=0)
    marks, cumulative = [], 0  # [cumulative samples, samples since the previous mark, address, SASS, wgmmas]
    for row in rows:
        cumulative += _int(row, SAMPLES)
        source = row["Source"].strip()
        if not (most and hot * most <= _int(row, EXECUTED) <= most / hot and any(m in source for m in MARKERS)):
            continue
        since = cumulative - (marks[-1][0] if marks else 0)
        if "HGMMA" in source and marks and marks[-1][4]:  # extend the run of wgmmas
            marks[-1][:3] = [cumulative, marks[-1][1] + since, row["Address"]]
            marks[-1][4] += 1
        else:
            marks.append([cumulative, since, row["Address"], source, int("HGMMA" in source)])
    return [(c / total, s / total, addr, f"{sass} ... (wgmma x {n})" if n > 1 else sass)
            for c, s, addr, sass, n in marks]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", help="ncu --page source --csv --print-source sass output")
    ap.add_argument("--top", type=int, default=25, help="instructions to list (default 25)")
    ap.add_argument("--hot", type=float, default=0.8,
                    help="hot loop: instructions executed within this factor of the busiest wgmma's count (default 0.8)")
    args = ap.parse_args(argv)
    if not 0.0 < args.hot <= 1.0:
        ap.error(f"--hot: expected a fraction in (0, 1], got {args.hot}")
    header, rows = load(args.csv)
    samples = sum(_int(r, SAMPLES) for r in rows)
    executed = sum(_int(r, EXECUTED) for r in rows)
    print(f"{args.csv}: {len(rows)} SASS instructions, {executed / 1e6:.0f} M executed (warp level), {samples} samples")
    print("stall reasons: " + "  ".join(f"{k} {100 * v:.1f}%" for k, v in list(reason_shares(header, rows).items())[:10]))
    print(f"\ntop {args.top} instructions by samples:")
    for share, addr, sass, reasons in top_instructions(header, rows, args.top):
        print(f"  {100 * share:5.1f}%  {addr[-6:]}  {sass[:64]:64s} " + " ".join(f"{r}:{n}" for r, n in reasons))
    print(f"\nhot loop (executed {args.hot:g}-{1 / args.hot:.2g} x the busiest wgmma), cumulative share at each marker:")
    for cumulative, since, addr, sass in hot_loop_phases(rows, args.hot):
        print(f"  {100 * cumulative:5.1f}%  (+{100 * since:4.1f})  {addr[-6:]}  {sass[:70]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
