"""One-off probe: the decode split launch prefetching key blocks into L2 ahead of its K/V ring.

Runs benchmarks.bench_paged's decode section with extra fa4 peers whose kernels were built with
stage3_fwd_kernel.hopper.kernel.L2_PREFETCH_BLOCKS = N (captured under that setting; FA4_CACHE=0 so
every build is traced here): fa4_paged_pfN and fa4_dense_pfN next to the default (0) peers.

    FA4_CACHE=0 python -m benchmarks.probe_l2_prefetch --ahead 2,4 [bench_paged decode args]
"""
from __future__ import annotations

import os
import sys

os.environ["FA4_CACHE"] = "0"

from benchmarks import bench_paged  # noqa: E402
from stage3_fwd_kernel.hopper import kernel  # noqa: E402


def _under(n: int, fn):
    def run():
        old, kernel.L2_PREFETCH_BLOCKS = kernel.L2_PREFETCH_BLOCKS, n
        try:
            return fn()
        finally:
            kernel.L2_PREFETCH_BLOCKS = old
    return run


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ahead = [2, 4]
    if "--ahead" in argv:
        i = argv.index("--ahead")
        ahead = [int(x) for x in argv[i + 1].split(",")]
        del argv[i:i + 2]
    plain = bench_paged.decode_peers

    def peers(t, official, call=bench_paged.DecodeCall(), flashinfer=None):
        out = plain(t, official, call, flashinfer)
        for n in ahead:
            out[f"fa4_paged_pf{n}"] = _under(n, out["fa4_paged"])
            out[f"fa4_dense_pf{n}"] = _under(n, out["fa4_dense"])
        return out

    bench_paged.decode_peers = peers
    return bench_paged.main(argv + ["--only", "decode"])


if __name__ == "__main__":
    sys.exit(main())
