"""The READMEs' performance tables, generated from committed results (never typed by hand).

    python -m benchmarks.ladder --resources   # compile each kernel (sm_90a, no GPU) and store registers/SMEM
    python -m benchmarks.ladder --write       # rewrite every generated table (root, stage 3, 4, 5 READMEs)
    python -m benchmarks.ladder               # print the stage 3 ladder

Inputs: the forward benchmark JSONs (benchmarks.bench_fwd) in benchmarks/results/ (a kernel's row
comes from the newest run that measured it, ratioed against the official FA4 of that same run),
benchmarks/results/stage3_resources_sm90a.json, and the newest backward, scheduler and paired runs
(BLOCKS lists every table and its README markers, e.g. <!-- ladder:start --> / <!-- ladder:end -->);
tests/test_benchmarks.py checks each table is current.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from .bench_bwd import summary as bwd_summary
from .bench_fwd import summary_table as fwd_summary_table
from .bench_sched import summary_table as sched_summary_table

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
# the GPU whose runs the tables show (its name is in every results file's name: fwd_h100_run12_...);
# TFLOP/s of two GPUs never share a table
GPU = "h100"
RESOURCES = RESULTS / "stage3_resources_sm90a.json"
README = ROOT / "stage3_fwd_kernel" / "README.md"
START, END = "<!-- ladder:start -->", "<!-- ladder:end -->"
PROD_START, PROD_END = "<!-- production:start -->", "<!-- production:end -->"
BWD_README = ROOT / "stage4_bwd_kernel" / "README.md"
SCHED_README = ROOT / "stage5_scheduling" / "README.md"
BWD_START, BWD_END = "<!-- bwd-results:start -->", "<!-- bwd-results:end -->"
SCHED_START, SCHED_END = "<!-- sched-results:start -->", "<!-- sched-results:end -->"
PAIRED_START, PAIRED_END = "<!-- paired-fa4:start -->", "<!-- paired-fa4:end -->"
PAIRED_BWD_START, PAIRED_BWD_END = "<!-- paired-bwd:start -->", "<!-- paired-bwd:end -->"
# the forward's targets, ratio to the official FA4 at 4k-16k keys: (d, dv) -> minimum
FWD_TARGETS = {(128, 128): 1.00, (64, 64): 1.10, (256, 256): 0.95, (192, 128): 0.95}
# the backward's targets (the default mode against the official FA4 at every length of BWD_SEQLENS): d -> minimum
BWD_TARGETS = {128: 1.05, 64: 1.05}
BWD_SEQLENS = (2048, 4096, 8192, 16384)
PAIRED_BWD_GPUS = ("h100", "h200")
# the name of the production backward in an ab_bwd run: its "production_variant" field, or in runs
# written while the production backward was stage 4's step 3 (no such field), step 3's name
LEGACY_BWD_PRODUCTION = "step3_rs"

STEPS = {  # bench_fwd's kernel name -> (module under stage3_fwd_kernel, what it adds)
    "step1_wgmma": ("hopper_step1_wgmma", "one warpgroup, wgmma (SS for QK^T, RS for PV), online softmax in registers"),
    "step2_tma": ("hopper_step2_tma", "+ TMA loads into a multi-stage SMEM pipeline with mbarriers"),
    "step3_warpspec": ("hopper_step3_warpspec", "+ warp specialization: producer warp, 2 consumer warpgroups in ping-pong, intra-warpgroup overlap (S_i with P_{i-1} V), masked blocks first"),
    "step4_fa4_softmax": ("hopper_step4_fa4_softmax", "+ FA4 softmax: conditional rescaling (warp vote), optional partial exp2 emulation"),
    "production": ("hopper", "the kernel fa4 runs: step 4's techniques composed with the production pipeline "
                             "(persistent CTAs, split tail, LPT order, varlen)"),
}
FA4 = "flash-attn-4 (official)"
# forward runs written while the production kernel was the ladder's step 4 name it so
LEGACY_FWD_PRODUCTION = ("step4_fa4_softmax", "ours:step4_fa4_softmax")


VARIANTS = {  # the production softmax policy varied, timed as extra rows: (label, technique)
    "variant:tau=0,emu=0": ("production, tau=0, no emulation", "classic rescaling, every exp2 on MUFU: the baseline for the two FA4 techniques"),
    "variant:tau=8,emu=0": ("production, tau=8, no emulation", "+ conditional rescaling: one warp vote per tile, rescale only when the max grows by > 8"),
    "variant:tau=8,emu=0.25": ("production, tau=8, 25% emulated", "+ 25% of exp2 on the FMA pipe (degree-3 polynomial)"),
}


def _by_run(path: Path):
    """Sort key: the number after "run" (run10 after run9), then the name."""
    m = re.search(r"run(\d+)", path.name)
    return (int(m.group(1)) if m else -1, path.name)


def bench_files() -> list[Path]:
    files = sorted(RESULTS.glob(f"fwd_{GPU}*.json"), key=_by_run)
    if not files:
        raise FileNotFoundError(f"no benchmarks/results/fwd_{GPU}*.json: run python -m benchmarks.bench_fwd on a GPU")
    return files


def impl_name(row: dict, doc: dict) -> str:
    """A forward row's kernel under today's names (LEGACY_FWD_PRODUCTION -> ours:production)."""
    if doc.get("production_step") == LEGACY_FWD_PRODUCTION[0] and row["impl"] == LEGACY_FWD_PRODUCTION[1]:
        return "ours:production"
    return row["impl"]


def _rows(files):
    """impl -> (tflops per (causal, seqlen), FA4 of the same run, run name); later runs win."""
    rows = {}
    for path in files:
        doc = json.loads(path.read_text())
        t = {(impl_name(r, doc), r["head_dim"], r["causal"], r["seqlen"]): r.get("tflops") for r in doc["results"]}
        for impl in {impl_name(r, doc) for r in doc["results"]}:
            vals = {(c, s): v for (i, d, c, s), v in t.items() if i == impl and d == 128 and v}
            if vals:
                fa4 = {(c, s): t.get((FA4, 128, c, s)) for (c, s) in vals}
                rows[impl] = (vals, fa4, path.stem, doc)
    return rows


def table(files, resources: dict) -> str:
    rows = _rows(files)
    cols = sorted({k for impl, (vals, _, _, _) in rows.items() for k in vals})
    head = " | ".join(f"{'causal' if c else 'non-causal'} {s // 1024}k" for c, s in cols)
    docs = {stem: doc for _, _, stem, doc in rows.values()}
    runs = "; ".join(f"{stem}: commit {doc.get('git_commit', '?')}" for stem, doc in sorted(docs.items()))
    any_doc = next(iter(docs.values()))
    lines = [f"d = 128, bf16, TFLOP/s on {any_doc['device']}; in parentheses the ratio to the official "
             f"flash-attn-4 {any_doc['versions'].get('flash-attn-4')} measured in the same run ({runs})",
             "", f"| step | technique | {head} | registers | SMEM | run |",
             "|---|---|" + "---|" * len(cols) + "---|---|---|"]

    def cells(impl):
        vals, fa4, stem, _ = rows[impl]
        out = []
        for col in cols:
            v, f = vals.get(col), fa4.get(col)
            out.append(f"{v:.0f} ({v / f:.2f}x)" if v and f else (f"{v:.0f}" if v else "-"))
        return out

    for key, (module, technique) in STEPS.items():
        impl = f"ours:{key}"
        if impl not in rows:
            continue
        res = resources.get(module, {})
        smem = f"{res['smem_bytes'] // 1024} KB" if res.get("smem_bytes") else "-"
        lines.append(f"| {module} | {technique} | " + " | ".join(cells(impl))
                     + f" | {res.get('registers', '-')} | {smem} | {rows[impl][2]} |")
    res4 = resources.get(STEPS["production"][0], {})  # the variants are the production kernel's
    for impl, (label, technique) in VARIANTS.items():
        if impl in rows:
            smem = f"{res4['smem_bytes'] // 1024} KB" if res4.get("smem_bytes") else "-"
            lines.append(f"| {label} | {technique} | " + " | ".join(cells(impl))
                         + f" | {res4.get('registers', '-')} | {smem} | {rows[impl][2]} |")
    if FA4 in rows:
        vals = rows[FA4][0]
        lines.append("| official flash-attn-4 | (peer, newest run) | "
                     + " | ".join(f"{vals[c]:.0f}" if vals.get(c) else "-" for c in cols) + " | | | |")
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
    resources = json.loads(RESOURCES.read_text()) if RESOURCES.is_file() else {}
    return table(bench_files(), resources)


def render_production() -> str:
    """Every head dim and seqlen for the production kernel, from the newest run that has them all."""
    full = [p for p in bench_files() if len({r["seqlen"] for r in json.loads(p.read_text())["results"]}) > 2]
    path = full[-1]
    doc = json.loads(path.read_text())
    return (f"`{path.relative_to(ROOT)}` ({doc['device']}, commit {doc['git_commit']}, "
            f"production step {doc['production_step']} with its defaults; peers in the same run)\n\n"
            + fwd_summary_table(doc))


def _newest(pattern) -> tuple[Path, dict]:
    files = sorted(RESULTS.glob(pattern), key=_by_run)
    if not files:
        raise FileNotFoundError(f"no benchmarks/results/{pattern}")
    return files[-1], json.loads(files[-1].read_text())


def render_bwd() -> str:
    """Backward TFLOP/s vs peers, plus the deterministic / default ratio of each kernel."""
    path, doc = _newest(f"bwd_{GPU}*.json")
    t = {(r["impl"], r["head_dim"], r["causal"], r["seqlen"]): r.get("tflops") for r in doc["results"]}
    ratios = []
    for (impl, d, c, sl), v in sorted(t.items()):
        if impl.endswith(" deterministic") and v and t.get((impl[:-len(" deterministic")], d, c, sl)):
            ratios.append(f"{impl[5:-len(' deterministic')]} d={d} {'causal' if c else 'full'} {sl // 1024}k: "
                          f"{v / t[(impl[:-len(' deterministic')], d, c, sl)]:.2f}")
    return (f"`{path.relative_to(ROOT)}` ({doc['device']}, commit {doc['git_commit']}; TFLOP/s, in parentheses "
            f"the ratio to the official flash-attn-4 {doc['versions'].get('flash-attn-4')} of the same run)\n\n"
            + bwd_summary(doc) + "\n\nDeterministic / default speed: " + "; ".join(ratios) + ".")


def render_sched() -> str:
    path, doc = _newest(f"sched_{GPU}*.json")
    return (f"`{path.relative_to(ROOT)}` ({doc['device']}, commit {doc['git_commit']}; speedup: forward rows "
            f"relative to the static order, backward rows relative to 'det. naive (n ascending)'; 'simulated' is "
            f"the simulator's prediction; 'bits': forward rows compare the output with the static order's, "
            f"deterministic backward rows compare two runs of the same order)\n\n" + sched_summary_table(doc))


def render_paired() -> str:
    """The fa4 route against the official FA4 in paired rounds (benchmarks.ab_fwd --impls fa4), the
    newest every-head-dim run: per-round ratio medians, and which of FWD_TARGETS they meet."""
    path, doc = _newest(f"ab_fwd_{GPU}_run*_fa4_all_dims.json")
    ratio = {(r["head_dim"], r["head_dim_v"], r["causal"], r["seqlen"]): r for r in doc["results"] if r["impl"] == "fa4"}
    seqlens = sorted({k[3] for k in ratio})
    lines = [f"`{path.relative_to(ROOT)}` ({doc['device']}, commit {doc['git_commit']}, "
             f"{doc['method'].split(',')[0]}; official time / fa4 time, median of the rounds, non-causal / causal)", "",
             "| head dims | " + " | ".join(f"{s // 1024}k" for s in seqlens) + " | target at 4k-16k | met? |",
             "|---|" + "---|" * (len(seqlens) + 2)]
    for (d, dv), target in FWD_TARGETS.items():
        if not any(k[:2] == (d, dv) for k in ratio):
            continue
        cells = [" / ".join(f"{ratio[(d, dv, c, s)]['ratio_median']:.3f}" if (d, dv, c, s) in ratio else "-"
                            for c in (False, True)) for s in seqlens]
        long = {c: [ratio[(d, dv, c, s)]["ratio_median"] for s in seqlens if s >= 4096 and (d, dv, c, s) in ratio]
                for c in (False, True)}
        name = f"d = {d}" if d == dv else f"({d}, {dv})"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {_against_target(long, target)} |")
    return "\n".join(lines)


def _against_target(long: dict, target: float) -> str:
    """The last two cells of a paired table's row: the target with the range measured at the lengths
    judged (4k-16k forward, BWD_SEQLENS backward), and which masks meet it (long: causal -> those ratios)."""
    nc, ca = (bool(long[c]) and min(long[c]) >= target for c in (False, True))
    verdict = "yes" if nc and ca else "non-causal only" if nc else "causal only" if ca else "no"
    both = long[False] + long[True]
    return f">= {target:.2f}x (now {min(both):.2f}-{max(both):.2f}) | {verdict}"


def render_paired_bwd() -> str:
    """The production backward (its defaults) against the official FA4 in paired rounds
    (benchmarks.ab_bwd): per head dim, the newest run that timed the defaults at two or more
    seqlens with both masks; which of BWD_TARGETS its ratios at BWD_SEQLENS meet. Newer runs of the
    same kernel (the same commit before any "+" suffix) that timed the defaults for only some cases
    are named, and their ratios count in the verdict too."""
    span = f"{BWD_SEQLENS[0] // 1024}k-{BWD_SEQLENS[-1] // 1024}k"
    lines = ["| head dim | run (commit) | " + " | ".join(f"{s // 1024}k" for s in BWD_SEQLENS) +
             f" | target at {span} | met? |", "|---|---|" + "---|" * len(BWD_SEQLENS) + "---|---|"]

    def defaults(doc, d):
        production = doc.get("production_variant", LEGACY_BWD_PRODUCTION)
        return {(r["causal"], r["seqlen"]): r["ratio_median"] for r in doc["results"]
                if r["impl"] == production and r["head_dim"] == d}

    # ratios, not TFLOP/s: an H200's run may follow an H100's (the run number orders them; the cell names the file)
    runs = sorted((p for gpu in PAIRED_BWD_GPUS for p in RESULTS.glob(f"ab_bwd_{gpu}_run*.json")),
                  key=_by_run, reverse=True)
    for d, target in BWD_TARGETS.items():
        for i, path in enumerate(runs):
            doc = json.loads(path.read_text())
            ratio = defaults(doc, d)
            seqlens = {s for _, s in ratio}
            if (len(seqlens) >= 2 and seqlens & set(BWD_SEQLENS)
                    and all((c, s) in ratio for c in (False, True) for s in seqlens)):
                break
        else:
            continue
        cells = [" / ".join(f"{ratio[(c, s)]:.3f}" for c in (False, True)) if s in seqlens else "-"
                 for s in BWD_SEQLENS]
        long = {c: [ratio[(c, s)] for s in seqlens if s in BWD_SEQLENS] for c in (False, True)}
        rounds = doc["method"].split(" ", 1)[0]
        run_cell = f"`{path.name}` ({doc['git_commit']}, {rounds} rounds)"
        kernel = doc["git_commit"].split("+")[0]
        for later_path in runs[:i]:
            later = json.loads(later_path.read_text())
            extra = defaults(later, d) if later["git_commit"].split("+")[0] == kernel else {}
            for (c, s), value in extra.items():
                if s in BWD_SEQLENS:
                    long[c].append(value)
            if extra:
                masks = "/".join(sorted({"causal" if c else "non-causal" for c, _ in extra}))
                run_cell += (f"; also `{later_path.name}` ({later['method'].split(' ', 1)[0]} rounds, {masks}: " +
                             ", ".join(f"{s // 1024}k {v:.3f}" for (c, s), v in sorted(extra.items())) + ")")
        lines.append(f"| d = {d} | {run_cell} | " + " | ".join(cells) + f" | {_against_target(long, target)} |")
    return "\n".join(lines)


ROOT_README = ROOT / "README.md"
ROOT_START, ROOT_END = "<!-- root-ladder:start -->", "<!-- root-ladder:end -->"


def render_root() -> str:
    """The compact ladder for the root README: d = 128 at 16k, each step's newest run."""
    rows = _rows(bench_files())
    cols = [(False, 16384), (True, 16384)]
    lines = [f"| step (d = 128, bf16, seqlen 16k, {GPU.upper()}) | non-causal TFLOP/s | causal TFLOP/s |",
             "|---|---|---|"]
    named = [(f"ours:{k}", f"{k.split('_', 1)[0]}: {m}") for k, (m, _) in STEPS.items()] + [(FA4, "official flash-attn-4")]
    for impl, label in named:
        if impl not in rows:
            continue
        vals, fa4, _, _ = rows[impl]
        cells = []
        for col in cols:
            v, f = vals.get(col), fa4.get(col)
            # the ratio is to the official kernel in the step's own run (it moves between runs), shown too
            cells.append("-" if not v else (f"{v:.0f}" if impl == FA4 else f"{v:.0f} ({v / f:.2f}x FA4's {f:.0f})"))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


BLOCKS = [  # (README, start marker, end marker, renderer): every generated table in the repository
    (ROOT_README, ROOT_START, ROOT_END, lambda: render_root()),
    (README, START, END, lambda: render()),
    (README, PROD_START, PROD_END, lambda: render_production()),
    (BWD_README, BWD_START, BWD_END, lambda: render_bwd()),
    (SCHED_README, SCHED_START, SCHED_END, lambda: render_sched()),
    (README, PAIRED_START, PAIRED_END, lambda: render_paired()),
    (ROOT_README, PAIRED_START, PAIRED_END, lambda: render_paired()),
    (ROOT_README, PAIRED_BWD_START, PAIRED_BWD_END, lambda: render_paired_bwd()),
]


def _replace(text, start, end, body):
    if start not in text:
        raise SystemExit(f"no {start} marker to replace")
    pre, rest = text.split(start, 1)
    return f"{pre}{start}\n{body}\n{end}{rest.split(end, 1)[1]}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--resources", action="store_true")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args(argv)
    if args.resources:
        RESOURCES.write_text(json.dumps(measure_resources(), indent=1))
    text = render()
    if args.write:
        for path, start, end, fn in BLOCKS:
            path.write_text(_replace(path.read_text(), start, end, fn()))
            print(f"updated {path.relative_to(ROOT)} ({start})")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
