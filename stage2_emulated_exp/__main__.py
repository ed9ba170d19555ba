"""python -m stage2_emulated_exp [--n N] [--out DIR]

Prints the coefficient table and the paper's accuracy table (CPU). With a CUDA device it then
runs the device checks (bit-exactness, MUFU accuracy, throughput) into --out; without one it
compiles the kernels for sm_90a and sm_100a, prints their resources, and shows the committed
H100 results.
"""
from __future__ import annotations

import argparse
import sys
import tempfile


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m stage2_emulated_exp", description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=4_000_000, help="inputs for the accuracy table (paper: 4M)")
    ap.add_argument("--out", default=None, help="where the GPU run writes its JSON (default: a temp dir)")
    args = ap.parse_args(argv)

    from .accuracy import accuracy_table
    from .minimax import coefficient_table

    print(coefficient_table(), "\n")
    print(accuracy_table(n=args.n), "\n")

    import torch

    if torch.cuda.is_available():
        from . import device_main

        return device_main.main(["--out", args.out or tempfile.mkdtemp(prefix="stage2_")])

    from . import gpu_kernel, results

    print("no CUDA device: compiling the GPU kernels instead (no launch)")
    for arch in ("sm_90a", "sm_100a"):
        for name, r in gpu_kernel.compile_only(arch, disassemble=False).items():
            res = next(iter(r["resources"].values()))
            print(f"  {arch:<8} {name:<13} registers {res['registers']:>3}  local-memory frame {res['frame_bytes']} B")
    print("\ncommitted results (H100):")
    print(" ", results.bitexact_summary())
    print(results.throughput_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
