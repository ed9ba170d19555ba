"""The stage 3 performance ladder, generated from committed results (never typed by hand).

    python benchmarks/ladder.py --resources   # compile each step (sm_90a, no GPU) and store registers/SMEM
    python benchmarks/ladder.py --write       # rewrite the table in stage3_fwd_kernel/README.md
    python benchmarks/ladder.py               # print it

Inputs: the newest forward benchmark JSON (bench_fwd.py) in benchmarks/results/ and
benchmarks/results/stage3_resources_sm90a.json. The README holds the table between
<!-- ladder:start --> and <!-- ladder:end -->; tests/test_benchmarks.py checks it is current.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
RESOURCES = RESULTS / "stage3_resources_sm90a.json"
README = ROOT / "stage3_fwd_kernel" / "README.md"
START, END = "<!-- ladder:start -->", "<!-- ladder:end -->"

STEPS = {
    "step1_wgmma": ("hopper_step1_wgmma", "one warpgroup, wgmma (SS for QK^T, RS for PV), online softmax in registers"),
    "step2_tma": ("hopper_step2_tma", "+ TMA loads into a multi-stage SMEM pipeline with mbarriers"),
    "step3_warpspec": ("hopper_step3_warpspec", "+ warp specialization: producer warp, 2 consumer warpgroups in ping-pong"),
    "step4_fa4_softmax": ("hopper_step4_fa4_softmax", "+ FA4 softmax: conditional rescaling (tau=8, warp vote), partial exp2 emulation"),
}
FA4 = "flash-attn-4 (official)"


def latest_bench() -> Path:
    """The forward benchmark with the most ladder steps measured (ties: newest name)."""
    cands = sorted(RESULTS.glob("fwd_h100*.json"))
    if not cands:
        raise FileNotFoundError("no benchmarks/results/fwd_h100*.json: run benchmarks/bench_fwd.py on a GPU")

    def n_steps(p):
        return len({r["impl"] for r in json.loads(p.read_text())["results"] if r["impl"].startswith("ours:")})

    return max(cands, key=lambda p: (n_steps(p), p.name))


def table(bench: dict, resources: dict) -> str:
    t = {(r["impl"], r["head_dim"], r["causal"], r["seqlen"]): r.get("tflops") for r in bench["results"]}
    seqlens = sorted({r["seqlen"] for r in bench["results"] if r["head_dim"] == 128})
    cols = [(c, s) for c in (False, True) for s in seqlens]
    head = " | ".join(f"{'causal' if c else 'non-causal'} {s // 1024}k" for c, s in cols)
    lines = [f"d = 128, bf16, TFLOP/s on {bench['device']} (commit {bench.get('git_commit', '?')}; "
             f"ratio to the official flash-attn-4 {bench['versions'].get('flash-attn-4')} measured in the same run)",
             "", f"| step | technique | {head} | registers | SMEM |", "|---|---|" + "---|" * len(cols) + "---|---|"]
    for key, (module, technique) in STEPS.items():
        vals = [t.get((f"ours:{key}", 128, c, s)) for c, s in cols]
        if not any(vals):
            continue
        fa4 = [t.get((FA4, 128, c, s)) for c, s in cols]
        cells = [f"{v:.0f} ({v / f:.2f}x)" if v and f else (f"{v:.0f}" if v else "-") for v, f in zip(vals, fa4)]
        res = resources.get(module, {})
        regs = res.get("registers", "-")
        smem = f"{res['smem_bytes'] // 1024} KB" if res.get("smem_bytes") else "-"
        lines.append(f"| {module} | {technique} | " + " | ".join(cells) + f" | {regs} | {smem} |")
    fa4_cells = [f"{t[(FA4, 128, c, s)]:.0f}" if t.get((FA4, 128, c, s)) else "-" for c, s in cols]
    lines.append(f"| official flash-attn-4 | (peer) | " + " | ".join(fa4_cells) + " | | |")
    return "\n".join(lines)


def measure_resources() -> dict:
    import importlib

    out = {}
    for module, _ in STEPS.values():
        try:
            mod = importlib.import_module(f"stage3_fwd_kernel.{module}")
        except ModuleNotFoundError:
            continue
        rep = mod.compile_only(dtype="bf16", head_dim=128, head_dim_v=128, causal=False).report
        out[module] = {"registers": rep.get("registers"), "smem_bytes": rep.get("smem_bytes"),
                       "spill_stores": rep.get("spill_stores"), "config": "bf16 d=128 non-causal, sm_90a"}
        print(module, out[module], flush=True)
    return out


def render() -> str:
    bench = json.loads(latest_bench().read_text())
    resources = json.loads(RESOURCES.read_text()) if RESOURCES.is_file() else {}
    return table(bench, resources)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--resources", action="store_true")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args(argv)
    if args.resources:
        RESOURCES.write_text(json.dumps(measure_resources(), indent=1))
    text = render()
    if args.write:
        readme = README.read_text()
        if START not in readme:
            raise SystemExit(f"{README} has no {START} marker")
        pre, rest = readme.split(START, 1)
        post = rest.split(END, 1)[1]
        README.write_text(f"{pre}{START}\n{text}\n{END}{post}")
        print(f"updated {README}")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
