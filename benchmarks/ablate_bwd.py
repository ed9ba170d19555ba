"""Ablation timing of the production Hopper backward (stage 4 step 3): which part of a tile costs what.

    python benchmarks/ablate_bwd.py --out benchmarks/results/probe_bwd_h100_ablation.json [--dims 128]

Each variant is step 3's source with one piece cut out by a text substitution (written to a
temporary module, never committed): its results are WRONG and only its speed means anything.
If removing a piece speeds the kernel up by x%, that piece (or what waits on it) costs about x%
of a tile; if nothing moves, the piece is hidden under something else. All variants and the
official FA4 are timed in one process by bench_bwd (same shapes, same timer).
"""
from __future__ import annotations

import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_bwd  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE = os.path.join(ROOT, "stage4_bwd_kernel", "hopper", "backward.py")

# name -> (what is cut, regex, replacement); each regex must match exactly once
ABLATIONS = {
    "no_dq_reduce": ("the writer warp's reduce-add of dQ, bulk or TMA tensor (it still waits and hands buffers back)",
                     r"^(\s*)if const_expr\(self\.dq_frag\):\n(?:.*\n)*?\s*else:\n"
                     r"\s*cute\.copy\(tma_atom_dQ, tDsD\[None, buf \* NUM_WG_MMA \+ w\], tDgD\[None, g_m, g_n\]\)$",
                     r"\1pass"),
    "no_exp": ("exp2 of the scores (P^T = S^T * scale - lse2, one FFMA)",
               r"cute\.math\.exp2\(s \* softmax_scale_log2 - lse2, fastmath=True\)", "s * softmax_scale_log2 - lse2"),
    "no_dq_gemm": ("the dQ = dS K wgmma (zeros are stored and reduced instead)",
                   r"^(\s*)if const_expr\(self\.dq_swap_ab\):\n\s*gemm_issue\(tiled_mma_dQ, acc_dQ, .*\n"
                   r"\s*else:\n\s*gemm_issue\(tiled_mma_dQ, acc_dQ, .*$", r"\1acc_dQ.fill(0.0)"),
    "no_dq_store": ("the dQ registers -> sdQ stores, either layout (the dQ wgmma then partly dead-code eliminated)",
                    r"^(\s*)if const_expr\(self\.dq_frag\):\n\s*dst = tQsQ_frag.*\n.*\n\s*else:\n"
                    r"\s*cute\.copy\(smem_copy_dQ, thr_smem_dQ\.retile\(acc_dQ\).*$", r"\1pass"),
}


def write_variants(directory: str) -> dict[str, str]:
    """One module per ablation in `directory`; returns bench_bwd step name -> module name."""
    text = open(SOURCE).read()
    steps = {}
    for name, (_, pattern, repl) in ABLATIONS.items():
        variant, n = re.subn(pattern, repl, text, flags=re.M)
        if n != 1:
            raise RuntimeError(f"ablation {name}: pattern matched {n} times in {SOURCE}; update ABLATIONS")
        # its own STEP name, so the compile cache never hands back the intact kernel
        variant = variant.replace('STEP = "hopper_bwd_step3_rs"', f'STEP = "ablate_{name}"')
        module = f"_ablate_bwd_{name}"
        with open(os.path.join(directory, module + ".py"), "w") as f:
            f.write(variant)
        steps[f"ablate_{name}"] = module
    return steps


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    tmp = tempfile.mkdtemp(prefix="fa4_ablate_bwd_")
    sys.path.insert(0, tmp)
    steps = write_variants(tmp)
    bench_bwd.STEPS.update(steps)
    for name, (what, _, _) in ABLATIONS.items():
        print(f"ablate_{name}: without {what}")
    return bench_bwd.main(argv + ["--no-deterministic", "--steps", ",".join(["step3_rs", *steps])])


if __name__ == "__main__":
    sys.exit(main())
