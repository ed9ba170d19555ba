"""Compile every stage-3 Hopper step for every supported config (sm_90a, no GPU needed) and print
one resource line each. CI compiles a subset (tests/test_stage3_hopper.py); run this locally after
touching a kernel:

    python -m stage3_fwd_kernel.compile_all            # all steps
    python -m stage3_fwd_kernel.compile_all hopper_step2_tma
"""
from __future__ import annotations

import importlib
import sys
import time

from stage3_fwd_kernel import sass_report

STEPS = ["hopper_step1_wgmma", "hopper_step2_tma", "hopper_step3_warpspec", "hopper_step4_fa4_softmax"]
HEAD_DIMS = [(64, 64), (96, 96), (128, 128), (192, 128), (256, 256)]


def main(steps) -> int:
    failures = 0
    for name in steps:
        try:
            mod = importlib.import_module(f"stage3_fwd_kernel.{name}")
        except ModuleNotFoundError:
            print(f"{name}: not written yet, skipped")
            continue
        for dtype in ("bf16", "fp16"):
            for d, dv in HEAD_DIMS:
                for causal in (False, True):
                    t0 = time.time()
                    try:
                        rep = mod.compile_only(dtype=dtype, head_dim=d, head_dim_v=dv, causal=causal).report
                    except Exception as exc:  # report and keep going: the point is the whole table
                        failures += 1
                        print(f"FAIL {name} {dtype} d={d}/{dv} causal={causal}: {type(exc).__name__}: {exc}")
                        continue
                    bad = rep["spill_stores"] or rep["spill_loads"] or rep["LDL/STL"] or not rep["HGMMA"]
                    failures += bool(bad)
                    print(("SPILL " if bad else "ok    ")
                          + sass_report.format_report(f"{name} {dtype} d={d}/{dv} causal={causal}", rep)
                          + f" ({time.time() - t0:.1f} s)")
    return failures


if __name__ == "__main__":
    sys.exit(1 if main(sys.argv[1:] or STEPS) else 0)
