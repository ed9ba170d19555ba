"""Compile every stage-4 kernel configuration for sm_90a and print the resource table.

    python -m stage4_bwd_kernel.compile_all            # full matrix: 5 head dims x 2 dtypes x causal x deterministic
    python -m stage4_bwd_kernel.compile_all --quick    # bf16 only

No GPU needed. Each row: registers (steps 2-3 and the production kernel: the launch cap, setmaxnreg
then moves them), spills, shared memory, HGMMA / REDG / UBLKRED (the bulk dQ reduce) / MUFU counts.
Step 3 and the production kernel (``stage4_bwd_kernel.hopper``) compile only the head dims their
register-sourced layout fits (``RS_HEAD_DIMS``).
"""
from __future__ import annotations

import argparse
import re
import time

from stage4_bwd_kernel import hopper, hopper_step1, hopper_step2_warpspec, hopper_step3_rs, postprocess, preprocess
from stage4_bwd_kernel.common import SUPPORTED_HEAD_DIMS

KERNELS = {"hopper_step1": hopper_step1, "hopper_step2_warpspec": hopper_step2_warpspec,
           "hopper_step3_rs": hopper_step3_rs, "production": hopper}
RS_ONLY = {"hopper_step3_rs", "production"}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args(argv)
    dtypes = ("bf16",) if a.quick else ("bf16", "fp16")
    print("| kernel | dtype | d/dv | causal | det | regs | spills | smem KB | HGMMA | REDG.F32x2 | UBLKRED | MUFU.EX2 | s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for dt in dtypes:
        for d, dv in SUPPORTED_HEAD_DIMS:
            for label, mod in KERNELS.items():
                if label in RS_ONLY and (d, dv) not in hopper.RS_HEAD_DIMS:
                    continue
                for causal in (False, True):
                    for det in (False, True):
                        t = time.time()
                        c = mod.compile_only(dt, d, dv, causal=causal, deterministic=det)
                        r = c.report
                        reds = len(re.findall(r"\bREDG\.E\.ADD\.F32x2", c.sass))
                        bulk = len(re.findall(r"\bUBLKRED\b", c.sass))
                        print(f"| {label} | {dt} | {d}/{dv} | {causal} | {det} | {r['registers']} | "
                              f"{r['spill_stores']}/{r['spill_loads']} | {r['smem_bytes'] / 1024:.0f} | {r['HGMMA']} | "
                              f"{reds} | {bulk} | {r['MUFU.EX2']} | {time.time() - t:.1f} |", flush=True)
            for name, c in (("preprocess", preprocess.compile_only(dt, d, dv)),
                            ("postprocess", postprocess.compile_only(dt, d))):
                r = c.report
                print(f"| {name} | {dt} | {d}/{dv} | - | - | {r['registers']} | {r['spill_stores']}/{r['spill_loads']} "
                      f"| 0 | - | - | - | - | - |", flush=True)


if __name__ == "__main__":
    main()
