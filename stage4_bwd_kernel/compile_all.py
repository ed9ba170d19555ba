"""Compile every stage-4 kernel configuration for sm_90a and print the resource table.

    python -m stage4_bwd_kernel.compile_all            # full matrix: 5 head dims x 2 dtypes x causal x deterministic
    python -m stage4_bwd_kernel.compile_all --quick    # bf16 only

No GPU needed. Each row: registers (steps 2-3: the launch cap, setmaxnreg then moves them), spills,
shared memory, HGMMA / REDG / UBLKRED (step 3's bulk reduce) / MUFU counts. Step 3 compiles only the
head dims its register-sourced layout fits (``hopper_step3_rs.RS_HEAD_DIMS``).
"""
from __future__ import annotations

import argparse
import re
import time

from stage4_bwd_kernel import hopper_step1, hopper_step2_warpspec, postprocess, preprocess
from stage4_bwd_kernel.hopper import backward as hopper_step3_rs
from stage4_bwd_kernel.common import SUPPORTED_HEAD_DIMS


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args(argv)
    dtypes = ("bf16",) if a.quick else ("bf16", "fp16")
    print("| kernel | dtype | d/dv | causal | det | regs | spills | smem KB | HGMMA | REDG.F32x2 | UBLKRED | MUFU.EX2 | s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for dt in dtypes:
        for d, dv in SUPPORTED_HEAD_DIMS:
            for mod in (hopper_step1, hopper_step2_warpspec, hopper_step3_rs):
                if mod is hopper_step3_rs and (d, dv) not in hopper_step3_rs.RS_HEAD_DIMS:
                    continue
                for causal in (False, True):
                    for det in (False, True):
                        t = time.time()
                        c = mod.compile_only(dt, d, dv, causal=causal, deterministic=det)
                        r = c.report
                        reds = len(re.findall(r"\bREDG\.E\.ADD\.F32x2", c.sass))
                        bulk = len(re.findall(r"\bUBLKRED\b", c.sass))
                        print(f"| {mod.STEP} | {dt} | {d}/{dv} | {causal} | {det} | {r['registers']} | "
                              f"{r['spill_stores']}/{r['spill_loads']} | {r['smem_bytes'] / 1024:.0f} | {r['HGMMA']} | "
                              f"{reds} | {bulk} | {r['MUFU.EX2']} | {time.time() - t:.1f} |", flush=True)
            for name, c in (("preprocess", preprocess.compile_only(dt, d, dv)),
                            ("postprocess", postprocess.compile_only(dt, d))):
                r = c.report
                print(f"| {name} | {dt} | {d}/{dv} | - | - | {r['registers']} | {r['spill_stores']}/{r['spill_loads']} "
                      f"| 0 | - | - | - | - | - |", flush=True)


if __name__ == "__main__":
    main()
