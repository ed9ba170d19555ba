"""A cold kernel's compile, with and without the DSL's own JIT engine, paired in one process.

    python -m benchmarks.bench_cold_compile [--head-dim 96] [--causal] [--rounds 3]
                                            [--out benchmarks/results/link_ab_h200.json]

fa4's disk cache exports every fresh launchable kernel to an object file anyway. Two ways to get a
callable from a cold compile:

* engine: `cute.compile` as the DSL does it by default (it builds an MCJIT engine, then the object its
  TVM-FFI function links), then fa4's export for the disk;
* linked: `cute.compile(..., no_jit_engine=True)`, fa4's export, and the export linked back
  (`fa4._cache.load_object`) -- what fa4 does since the cold path was changed.

Each round compiles the same Hopper forward both ways (the DSL's in-memory cache off), in
alternating order, and reports wall and CPU seconds of the compile, the export and the link. Round
0 includes the process's one-time warm-up. Runs without a GPU too (fake tensors, sm_90a).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time


def _one(mode: str, key, build, symbol: str) -> dict:
    from fa4 import _cache
    from stage3_fwd_kernel import compile_cache as cc

    t0, c0 = time.perf_counter(), time.process_time()
    comp, detached = cc._compile(key, build, detach=(mode == "linked"))
    t1, c1 = time.perf_counter(), time.process_time()
    data = _cache.export_object(comp.fn, symbol)
    t2, c2 = time.perf_counter(), time.process_time()
    if detached:
        with tempfile.TemporaryDirectory() as d:
            path = pathlib.Path(d) / f"{symbol}.o"
            path.write_bytes(data)
            _cache.load_object(path, symbol)
    t3 = time.perf_counter()
    return dict(mode=mode, detached=detached, compile=t1 - t0, compile_cpu=c1 - c0, export=t2 - t1,
                export_cpu=c2 - c1, link=t3 - t2, total=t3 - t0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--head-dim", type=int, default=96)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    os.environ["CUTE_DSL_NO_CACHE"] = "1"  # every compile is a cold one
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    from stage3_fwd_kernel import compile_cache as cc
    from stage3_fwd_kernel.hopper import host

    cc.set_store(None)
    seen: dict = {}
    real = cc._compile

    def spy(key, build, detach=False):  # the launch's key and build, compiled once here
        seen["key"], seen["build"] = key, build
        return real(key, build, detach)

    cc._compile = spy
    try:
        host.compile_only("bf16", args.head_dim, causal=args.causal, launchable=True)
    finally:
        cc._compile = real
    rows = []
    for r in range(args.rounds):
        for mode in (("engine", "linked") if r % 2 == 0 else ("linked", "engine")):
            row = dict(round=r, **_one(mode, seen["key"], seen["build"], f"k{r}{mode}"))
            rows.append(row)
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    if args.out:
        doc = {"command": "python -m benchmarks.bench_cold_compile " + " ".join(sys.argv[1:] if argv is None else argv),
               "config": {"head_dim": args.head_dim, "causal": args.causal, "dtype": "bf16"}, "results": rows}
        pathlib.Path(args.out).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
