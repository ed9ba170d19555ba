"""Compile every default Hopper build of a configuration grid for sm_90a and list what ptxas made of it.

    python -m benchmarks.inspect.resource_scan --out resource_scan.json [--pass fwd,bwd] [--dims 64,128x64]
    python -m benchmarks.inspect.resource_scan --part 0/2 --out a.json &   # the grid in two processes,
    python -m benchmarks.inspect.resource_scan --part 1/2 --out b.json     # then one file of both:
    python -m benchmarks.inspect.resource_scan --merge a.json b.json --out resource_scan.json

No GPU: each build is the one the production entry points would launch for that configuration (the
defaults of ``BackwardOptions.for_config`` and the forward's tile choice), compiled with fake tensors.
The grid: head dims x walks (non-causal, causal, causal + (1024, 0), a (1024, 1024) band) x softcap 0 / 30
x, for the backward, default / deterministic mode x dense / varlen, and for the forward, dense / varlen x
short / 16k keys (the tile choice depends on the key count). One line per build (registers per thread,
spilled bytes, serialized wgmmas, shared memory), then the builds that spill or serialize.

Why: a spill that only one configuration has is easy to miss in the per-feature compile tests, and
such a build can run 10-20% slow (the d = 64 varlen backward, log 2026-12-04). The stages' own
``compile_all`` modules list the lessons' builds (dense, no variants, both dtypes); this scan covers the
product's defaults over the variants and varlen. ``--part i/n`` runs
every n-th build from the i-th, so that n processes share the grid.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

WALKS = {"nc": (False, (None, None)), "causal": (True, (None, None)), "cwin": (True, (1024, 0)),
         "band": (False, (1024, 1024))}
DIMS = "64,96,128,128x64,192x128,256"
REPORT_KEYS = ("registers", "spill_stores", "spill_loads", "wgmma_serialized", "smem_bytes")


def grid(passes, dims, walks, softcaps=(0.0, 30.0)) -> list[dict]:
    """The builds of the scan, in order: one dict of compile_only keywords (+ "pass", "walk") each."""
    rows = []
    for pass_, (d, dv), walk, cap in itertools.product(passes, dims, walks, softcaps):
        causal, window = WALKS[walk]
        base = {"pass": pass_, "walk": walk, "head_dim": d, "head_dim_v": dv, "causal": causal,
                "window_size": window, "softcap": cap}
        if pass_ == "bwd":
            rows += [dict(base, deterministic=det, varlen=varlen) for det, varlen in itertools.product((False, True), repeat=2)]
        else:
            rows += [dict(base, varlen=varlen, seqlen_k=sk) for varlen, sk in itertools.product((False, True), (None, 16384))]
    return rows


def compile_row(case: dict) -> dict:
    """Compile one build of the grid; its case plus the report's resources (or the error, by name)."""
    kwargs = {k: v for k, v in case.items() if k not in ("pass", "walk")}
    if case["pass"] == "bwd":
        from stage4_bwd_kernel.hopper.backward import compile_only
    else:
        from stage3_fwd_kernel.hopper.host import compile_only
    start = time.time()
    try:
        report = compile_only(**kwargs).report
        found = {k: report.get(k) for k in REPORT_KEYS}
    except Exception as e:  # a configuration the kernels refuse is a finding too
        found = {"error": f"{type(e).__name__}: {e}"[:300]}
    return dict(case, **found, compile_s=round(time.time() - start, 1))


def flagged(row: dict) -> bool:
    return bool(row.get("spill_stores") or row.get("spill_loads") or row.get("wgmma_serialized") or row.get("error"))


def describe(row: dict) -> str:
    mode = ("det " if row.get("deterministic") else "") + ("varlen " if row["varlen"] else "")
    keys = f" sk={row['seqlen_k']}" if row.get("seqlen_k") else ""
    what = row.get("error") or (f"{row['registers']} regs, spill {row['spill_stores']} / {row['spill_loads']} B"
                                f"{', serialized ' + str(row['wgmma_serialized']) if row['wgmma_serialized'] else ''}")
    return (f"{row['pass']} d={row['head_dim']}x{row['head_dim_v']} {row['walk']:6} cap={row['softcap']:g} "
            f"{mode}{keys}: {what}")


def parse_dims(text: str) -> list[tuple[int, int]]:
    try:
        return [(int(a), int(b or a)) for a, _, b in (x.partition("x") for x in text.split(",") if x)]
    except ValueError:
        raise SystemExit(f"--dims: expected d or dxdv, comma-separated (e.g. 64,192x128), got {text!r}") from None


def write_json(path: str, doc: dict) -> None:
    """The header indented, then one line per build (a 384-build scan: about 110 KB)."""
    head = json.dumps({k: v for k, v in doc.items() if k != "results"}, indent=1)[:-2]
    rows = ",\n".join("  " + json.dumps(r) for r in doc["results"])
    with open(path, "w") as f:
        f.write(f'{head},\n "results": [\n{rows}\n ]\n}}\n')


def merge(paths, out) -> int:
    """One results file from the files of --part runs (their headers must name the same sources)."""
    if not out:
        raise SystemExit("--merge: needs --out")
    docs = [json.load(open(p)) for p in paths]
    if len({d["source_digest"] for d in docs}) != 1:
        raise SystemExit(f"--merge: {', '.join(paths)} come from different sources (source_digest differs)")
    doc = dict(docs[0], command=" && ".join(d["command"] for d in docs),
               results=[r for d in docs for r in d["results"]])
    write_json(out, doc)
    bad = [r for r in doc["results"] if flagged(r)]
    print(f"{out}: {len(doc['results'])} builds, {len(bad)} spill, serialize or fail")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pass", dest="passes", default="fwd,bwd", help="fwd, bwd or both")
    ap.add_argument("--dims", default=DIMS, help="head dims, d or dxdv")
    ap.add_argument("--walks", default=",".join(WALKS), help=f"of {', '.join(WALKS)}")
    ap.add_argument("--part", default="0/1", help="i/n: every n-th build from the i-th")
    ap.add_argument("--out", default=None, help="JSON of every build's row")
    ap.add_argument("--merge", nargs="+", default=None, metavar="PART_JSON",
                    help="write --out from the JSON of --part runs instead of compiling")
    args = ap.parse_args(argv)
    if args.merge:
        return merge(args.merge, args.out)
    passes = [p for p in args.passes.split(",") if p]
    walks = [w for w in args.walks.split(",") if w]
    if set(passes) - {"fwd", "bwd"} or set(walks) - set(WALKS):
        raise SystemExit(f"--pass: fwd / bwd; --walks: of {', '.join(WALKS)} (got {args.passes!r}, {args.walks!r})")
    try:
        index, parts = (int(x) for x in args.part.split("/"))
        assert 0 <= index < parts
    except (ValueError, AssertionError):
        raise SystemExit(f"--part: expected i/n with 0 <= i < n, got {args.part!r}") from None
    os.environ.setdefault("FA4_CACHE", "0")  # what ptxas makes now, not a cached build
    cases = grid(passes, parse_dims(args.dims), walks)[index::parts]
    rows = []
    for i, case in enumerate(cases):
        rows.append(compile_row(case))
        print(f"[{i + 1}/{len(cases)}] {describe(rows[-1])} ({rows[-1]['compile_s']} s)", flush=True)
    bad = [r for r in rows if flagged(r)]
    print(f"\n{len(bad)} of {len(rows)} builds spill, serialize their wgmmas or fail:")
    for r in bad:
        print("  " + describe(r))
    if args.out:
        from ..bench_fwd import source_commit, source_digest, versions

        doc = {"device": "none: compiled for sm_90a with fake tensors", "versions": versions(),
               "git_commit": source_commit(), "source_digest": source_digest(),
               "command": "python -m benchmarks.inspect.resource_scan " + " ".join(sys.argv[1:] if argv is None else argv),
               "results": rows}
        write_json(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
