"""Forward attention TFLOP/s: the production kernel, the stage 3 lessons and their peers, measured in one run.

    python -m benchmarks.bench_fwd --out benchmarks/results/fwd_h200.json [--plot fwd_h200.png] [--quick]

Problem grid: bf16, 32k tokens per batch (batch = 32768 / seqlen), hidden 2048
(heads = 2048 / head_dim), seqlen 1k..16k. FLOPs = 4 * b * h * s^2 * d (2 * b * h * s^2 *
(d_qk + d_v) when they differ), halved for causal. Each number is the median of
triton.testing.do_bench (CUDA events), peers measured in the same process, beside ours.
Every implementation's output is compared with the official FA4's on the first config, so a
fast wrong kernel cannot enter the table.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import pathlib
import platform
import subprocess
import sys
import time
import traceback

import torch

import stage3_fwd_kernel  # noqa: F401  (picks the DSL's target before a peer's import brings in cutlass)
from stage3_fwd_kernel.runner import visible_pairs

# the lessons, then the kernel fa4 runs (its stable entry module); every one has attention_forward
LADDER = {
    "step1_wgmma": "stage3_fwd_kernel.hopper_step1_wgmma",
    "step2_tma": "stage3_fwd_kernel.hopper_step2_tma",
    "step3_warpspec": "stage3_fwd_kernel.hopper_step3_warpspec",
    "step4_fa4_softmax": "stage3_fwd_kernel.hopper_step4_fa4_softmax",
    "production": "stage3_fwd_kernel.hopper",
}
PRODUCTION = "production"
HEAD_DIMS = [(64, 64), (128, 128), (256, 256), (192, 128)]
SEQLENS = [1024, 2048, 4096, 8192, 16384]


def flops(batch, heads, seqlen, d, dv, causal, window=None):
    """Forward FLOPs, two GEMMs per (query, key) pair: the full square, half of it causal (the
    convention of FlashAttention's benchmarks), or with a window (left, right) the pairs it sees."""
    if window is not None and tuple(window) != (None, None):
        return 2.0 * batch * heads * visible_pairs(seqlen, seqlen, *window, causal) * (d + dv)
    f = 2.0 * batch * heads * seqlen * seqlen * (d + dv)
    return f / 2 if causal else f


def timer():
    try:
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=25, rep=150, return_mode="median"), "triton.testing.do_bench median"
    except ImportError:
        def events(fn, iters=30):
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            ts = []
            for _ in range(iters):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record(); fn(); e.record(); torch.cuda.synchronize()
                ts.append(s.elapsed_time(e))
            return sorted(ts)[len(ts) // 2]

        return events, "CUDA events median of 30"


def implementations(steps, variants=()):
    """name -> callable(q, k, v, causal) -> out, for everything importable here.

    variants: (tau, fraction) pairs of the production kernel's softmax policy, timed as extra rows
    (e.g. fraction 0 = all exponentials on MUFU) to show what each FA4 technique buys.
    """
    impls = {}
    try:
        from flash_attn.cute.interface import flash_attn_func as fa4_func

        def fa4(q, k, v, c):
            out = fa4_func(q, k, v, causal=c)
            return out[0] if isinstance(out, tuple) else out

        impls["flash-attn-4 (official)"] = fa4
    except Exception as exc:  # not installed, or no sm90 path
        print(f"  skip official flash-attn-4: {exc}")
    for step in steps:
        try:
            mod = importlib.import_module(LADDER[step])
            impls[f"ours:{step}"] = lambda q, k, v, c, m=mod: m.attention_forward(q, k, v, causal=c)[0]
        except ImportError as exc:
            print(f"  skip {step}: {exc}")
            continue
        if step == PRODUCTION:
            for tau, frac in variants:
                impls[f"variant:tau={tau:g},emu={frac:g}"] = (
                    lambda q, k, v, c, m=mod, t=tau, f=frac:
                    m.attention_forward(q, k, v, causal=c, rescale_threshold=t, emulation_fraction=f)[0])
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa(backend):
        def fn(q, k, v, c):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=c).transpose(1, 2)
        return fn

    impls["cuDNN (SDPA)"] = sdpa(SDPBackend.CUDNN_ATTENTION)
    impls["FA2 (SDPA)"] = sdpa(SDPBackend.FLASH_ATTENTION)
    return impls


def tokens(n: int) -> str:
    """A sequence length as the tables write it: 4096 -> "4k", 1000 -> "1000"."""
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def versions():
    v = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
         "cudnn": torch.backends.cudnn.version()}
    for pkg in ("nvidia-cutlass-dsl", "flash-attn-4", "triton", "flashinfer-python", "transformers"):
        try:
            from importlib.metadata import version

            v[pkg] = version(pkg)
        except Exception:
            v[pkg] = None
    return v


REPO = pathlib.Path(__file__).resolve().parents[1]
SOURCE_DIRS = ("stage0_reference", "stage1_online_softmax", "stage2_emulated_exp", "stage3_fwd_kernel",
               "stage4_bwd_kernel", "stage5_scheduling", "fa4", "benchmarks")


def source_digest(root: pathlib.Path = REPO) -> str:
    """sha256 (12 hex digits) of the Python sources the benchmarks run (SOURCE_DIRS, paths and bytes).
    A copy of the tree without .git (e.g. on a GPU machine) still names its code this way; run this on a
    checkout to find the commit a results file came from (`python -m benchmarks.bench_fwd --source-digest`)."""
    h = hashlib.sha256()
    for d in SOURCE_DIRS:
        for f in sorted((root / d).rglob("*.py")):
            if "__pycache__" not in f.parts:
                h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def source_commit(root: pathlib.Path = REPO) -> str:
    """$FA4_GIT_COMMIT if set, else this checkout's short commit (+ "+uncommitted" when the sources
    differ from it), else "unknown": results files carry source_digest() beside it either way."""
    if os.environ.get("FA4_GIT_COMMIT"):
        return os.environ["FA4_GIT_COMMIT"]
    try:
        def git(*args):
            return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        rev = git("rev-parse", "--short", "HEAD")
        if rev and git("status", "--porcelain", "--", *SOURCE_DIRS):
            rev += "+uncommitted"
        return rev or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def write_doc(path: str, module: str, argv, results: list, **fields) -> dict:
    """A results JSON as every benchmark here writes it: device, versions, commit (source_commit()) and
    source digest, the command line (module: e.g. "benchmarks.bench_fwd"), extra fields, then the rows."""
    doc = {"device": torch.cuda.get_device_name(), "versions": versions(),
           "git_commit": source_commit(), "source_digest": source_digest(), **fields,
           "command": f"python -m {module} " + " ".join(argv if argv is not None else sys.argv[1:]),
           "results": results}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    return doc


def main(argv=None) -> int:
    if "--source-digest" in (sys.argv[1:] if argv is None else argv):
        print(source_digest())  # to match a results file's source_digest to a checkout
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 epilog="--source-digest alone: print source_digest() of this checkout and exit")
    ap.add_argument("--out", required=True)
    ap.add_argument("--plot", default=None)
    ap.add_argument("--quick", action="store_true", help="seqlens 4k, 16k only")
    ap.add_argument("--steps", default=",".join(LADDER), help=f"kernels to include, of {', '.join(LADDER)}")
    ap.add_argument("--ladder-dims", default="128", help="head dims on which the lessons run (production: every dim)")
    ap.add_argument("--variants", default="",
                    help="production softmax variants 'tau:fraction,...', e.g. '0:0,8:0,8:0.375'")
    ap.add_argument("--variant-dims", default="64,128", help="head dims on which the variants run")
    ap.add_argument("--dims", default="", help="restrict to these QK head dims, e.g. '64,128'")
    args = ap.parse_args(argv)
    steps = [s for s in args.steps.split(",") if s]
    unknown = sorted(set(steps) - set(LADDER))
    if unknown:
        ap.error(f"--steps: unknown {', '.join(unknown)}; expected some of {', '.join(LADDER)}")
    if not torch.cuda.is_available():
        print("bench_fwd needs a CUDA GPU; committed results are in benchmarks/results/")
        return 2
    ladder_dims = {int(x) for x in args.ladder_dims.split(",")}
    seqlens = [4096, 16384] if args.quick else SEQLENS
    bench, timing_method = timer()
    variants = [tuple(float(x) for x in v.split(":")) for v in args.variants.split(",") if v]
    variant_dims = {int(x) for x in args.variant_dims.split(",") if x}
    dims = [hd for hd in HEAD_DIMS if not args.dims or str(hd[0]) in args.dims.split(",")]
    impls = implementations(steps, variants)
    ours_present = [n[5:] for n in impls if n.startswith("ours:")]
    # the kernel the summary compares with the official one: production, else the last lesson timed
    production = PRODUCTION if PRODUCTION in ours_present else (ours_present[-1] if ours_present else "none")
    print(f"device {torch.cuda.get_device_name()}  impls: {', '.join(impls)}")
    results, checked = [], set()
    t_start = time.time()
    for d, dv in dims:
        for causal in (False, True):
            for s in seqlens:
                b, h = 32768 // s, 2048 // d
                q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
                k = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
                v = torch.randn(b, s, h, dv, device="cuda", dtype=torch.bfloat16)
                ref = None
                for name, fn in impls.items():
                    if name.startswith("ours:") and name[5:] != production and d not in ladder_dims:
                        continue  # the lessons are measured at the ladder dims only
                    if name.startswith("variant:") and d not in variant_dims:
                        continue
                    row = {"impl": name, "head_dim": d, "head_dim_v": dv, "causal": causal, "seqlen": s,
                           "batch": b, "heads": h}
                    try:
                        out = fn(q, k, v, causal)
                        torch.cuda.synchronize()
                        key = (name, d, dv, causal)
                        if name == "flash-attn-4 (official)":
                            ref = out
                        if key not in checked and ref is not None and name != "flash-attn-4 (official)":
                            row["max_abs_diff_vs_fa4"] = (out.float() - ref.float()).abs().max().item()
                            checked.add(key)
                        ms = bench(lambda: fn(q, k, v, causal))
                        row.update(ms=ms, tflops=flops(b, h, s, d, dv, causal) / ms / 1e9)
                    except Exception as exc:
                        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
                        if os.environ.get("BENCH_TRACEBACK"):
                            traceback.print_exc()
                    results.append(row)
                    shown = f"{row['tflops']:7.1f} TFLOP/s" if "tflops" in row else f"ERROR {row['error'][:80]}"
                    print(f"  d={d}/{dv} causal={causal!s:5} s={s:5}  {name:26} {shown}", flush=True)
                del q, k, v, ref
    doc = write_doc(args.out, "benchmarks.bench_fwd", argv, results,
                    sms=torch.cuda.get_device_properties(0).multi_processor_count, timing=timing_method,
                    dtype="bf16", tokens_per_batch=32768, hidden=2048, production_step=production,
                    elapsed_s=round(time.time() - t_start, 1))
    print(f"wrote {args.out}")
    print(summary_table(doc))
    if args.plot:
        plot(doc, args.plot)
    return 0


def _lookup(doc):
    return {(r["impl"], r["head_dim"], r["head_dim_v"], r["causal"], r["seqlen"]): r.get("tflops")
            for r in doc["results"]}


def summary_table(doc) -> str:
    """Ratio of our most complete kernel of the run (production_step) to the official FA4, per config (markdown)."""
    t = _lookup(doc)
    ours = f"ours:{doc['production_step']}"
    lines = ["| head dim | causal | seqlen | ours TFLOP/s | FA4 TFLOP/s | cuDNN | FA2 | ours / FA4 |",
             "|---|---|---|---|---|---|---|---|"]
    seqlens = sorted({r["seqlen"] for r in doc["results"]})
    for d, dv in HEAD_DIMS:
        for causal in (False, True):
            for s in seqlens:
                vals = [t.get((n, d, dv, causal, s)) for n in (ours, "flash-attn-4 (official)", "cuDNN (SDPA)", "FA2 (SDPA)")]
                if vals[0] is None and vals[1] is None:
                    continue
                fmt = [f"{x:.0f}" if x else "-" for x in vals]
                ratio = f"{vals[0] / vals[1]:.2f}x" if vals[0] and vals[1] else "-"
                dim = f"{d}" if d == dv else f"{d}/{dv}"
                lines.append(f"| {dim} | {causal} | {s // 1024}k | " + " | ".join(fmt) + f" | {ratio} |")
    return "\n".join(lines)


def plot(doc, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = _lookup(doc)
    impls = list(dict.fromkeys(r["impl"] for r in doc["results"]))
    seqlens = sorted({r["seqlen"] for r in doc["results"]})
    fig, axes = plt.subplots(2, len(HEAD_DIMS), figsize=(4 * len(HEAD_DIMS), 7), sharey=True)
    for col, (d, dv) in enumerate(HEAD_DIMS):
        for row, causal in enumerate((False, True)):
            ax = axes[row][col]
            for name in impls:
                ys = [t.get((name, d, dv, causal, s)) for s in seqlens]
                if any(ys):
                    ax.plot([s // 1024 for s in seqlens], [y or float("nan") for y in ys], "o-", label=name, ms=3)
            ax.set_title(f"d={d}{'' if d == dv else f'/{dv}'} {'causal' if causal else 'non-causal'}")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("seqlen (k)")
            ax.grid(alpha=0.3)
            if col == 0:
                ax.set_ylabel("TFLOP/s")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"forward, bf16, 32k tokens, hidden 2048 - {doc['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
