"""Backward attention TFLOP/s: the production backward, the stage 4 lessons (default and deterministic), peers.

    python -m benchmarks.bench_bwd --out benchmarks/results/bwd_h200.json [--seqlens 8192] [--dims 64,128]
        [--steps step1,step3_rs,production] [--no-deterministic]

A lesson may carry a tile override, name@MxN (tile_m x tile_n), to time a candidate tile next to the
default one; a kernel that does not support the head dim records the error instead of a time.

Problem grid as the forward benchmark (bf16, 32k tokens per batch, hidden 2048). FLOPs = 2.5 x the
forward's (5 GEMMs instead of 2), halved for causal. Ours is timed on the backward kernels alone
(preprocess + main + postprocess) from a fixed (out, lse); peers are timed on their autograd
backward (``torch.autograd.grad(..., retain_graph=True)``), which runs their own
preprocess/main/postprocess the same way. ``.backward`` would also add into ``.grad`` on every call:
three elementwise kernels that are no part of the backward (~3-4% of the official time at 16k).
"""
from __future__ import annotations

import argparse
import importlib
import sys
import time

import torch

from .bench_fwd import flops, timer, write_doc

# the lessons, then the backward fa4 runs (its stable entry module; it takes no tile override)
STEPS = {"step1": "stage4_bwd_kernel.hopper_step1", "step2_warpspec": "stage4_bwd_kernel.hopper_step2_warpspec",
         "step3_rs": "stage4_bwd_kernel.hopper_step3_rs", "production": "stage4_bwd_kernel.hopper"}
PRODUCTION = "production"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seqlens", default="8192")
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--steps", default=",".join(STEPS), help="steps to time, each name or name@MxN")
    ap.add_argument("--no-deterministic", action="store_true", help="skip the deterministic rows")
    args = ap.parse_args(argv)
    labels = [x for x in args.steps.split(",") if x]
    for label in labels:
        if label.partition("@")[0] not in STEPS:
            ap.error(f"--steps: unknown step {label.partition('@')[0]!r}; expected one of {', '.join(STEPS)}")
    if not torch.cuda.is_available():
        print("bench_bwd needs a CUDA GPU; committed results are in benchmarks/results/")
        return 2
    bench, timing = timer()
    from stage3_fwd_kernel.hopper import attention_forward

    mods = {}  # label -> (module, tiles)
    for label in labels:
        name, _, tiles = label.partition("@")
        try:
            mods[label] = (importlib.import_module(STEPS[name]),
                           tuple(int(x) for x in tiles.split("x")) if tiles else None)
        except ImportError as exc:
            print(f"skip {label}: {exc}")
    dets = (False,) if args.no_deterministic else (False, True)
    try:
        from flash_attn.cute.interface import flash_attn_func as fa4_func
    except Exception as exc:
        fa4_func = None
        print(f"skip official flash-attn-4: {exc}")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    results = []
    t0 = time.time()
    for d in (int(x) for x in args.dims.split(",")):
        for causal in (False, True):
            for s in (int(x) for x in args.seqlens.split(",")):
                b, h = 32768 // s, 2048 // d
                q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
                out, lse = attention_forward(q, k, v, causal=causal)
                fl = 2.5 * flops(b, h, s, d, d, causal)
                cases = {}
                for name, (mod, tiles) in mods.items():
                    for det in dets:
                        cases[f"ours:{name}" + (" deterministic" if det else "")] = (
                            lambda m=mod, dt=det, tl=tiles: m.attention_backward(q, k, v, out, do, lse, causal=causal,
                                                                                deterministic=dt,
                                                                                **({"tiles": tl} if tl else {})))
                if fa4_func is not None:
                    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
                    o = fa4_func(qg, kg, vg, causal=causal)
                    o = o[0] if isinstance(o, tuple) else o
                    # autograd.grad, not .backward: .backward would also add into .grad on every call
                    # (three extra elementwise kernels the official backward itself does not run)
                    cases["flash-attn-4 (official)"] = lambda o=o, ins=(qg, kg, vg): torch.autograd.grad(
                        o, ins, do, retain_graph=True)
                qc, kc, vc = (t.detach().clone().transpose(1, 2).requires_grad_() for t in (q, k, v))
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    oc = torch.nn.functional.scaled_dot_product_attention(qc, kc, vc, is_causal=causal)
                cases["cuDNN (SDPA)"] = lambda oc=oc, ins=(qc, kc, vc): torch.autograd.grad(
                    oc, ins, do.transpose(1, 2), retain_graph=True)
                ref = None
                for name, fn in cases.items():
                    row = {"impl": name, "head_dim": d, "causal": causal, "seqlen": s, "batch": b, "heads": h}
                    try:
                        res = fn()
                        torch.cuda.synchronize()
                        if name == "ours:step1":
                            ref = res
                        elif name.startswith("ours:") and ref is not None:
                            row["max_abs_diff_vs_step1"] = max((a.float() - r.float()).abs().max().item()
                                                              for a, r in zip(res, ref))
                        ms = bench(fn)
                        row.update(ms=ms, tflops=fl / ms / 1e9)
                    except Exception as exc:
                        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
                    results.append(row)
                    shown = f"{row['tflops']:7.1f} TFLOP/s" if "tflops" in row else f"ERROR {row['error'][:80]}"
                    print(f"  d={d} causal={causal!s:5} s={s:5} {name:34} {shown}", flush=True)
                del q, k, v, do, out, lse
    doc = write_doc(args.out, "benchmarks.bench_bwd", argv, results, production_step=PRODUCTION, timing=timing,
                    dtype="bf16", tokens_per_batch=32768, hidden=2048, flops="2.5 x forward, halved for causal",
                    elapsed_s=round(time.time() - t0, 1))
    print(summary(doc))
    return 0


def summary(doc) -> str:
    t = {(r["impl"], r["head_dim"], r["causal"], r["seqlen"]): r.get("tflops") for r in doc["results"]}
    impls = list(dict.fromkeys(r["impl"] for r in doc["results"]))
    keys = sorted({(r["head_dim"], r["causal"], r["seqlen"]) for r in doc["results"]})
    lines = ["| config | " + " | ".join(impls) + " |", "|---|" + "---|" * len(impls)]
    for d, c, s in keys:
        fa4 = t.get(("flash-attn-4 (official)", d, c, s))
        cells = []
        for i in impls:
            v = t.get((i, d, c, s))
            cells.append("-" if not v else (f"{v:.0f} ({v / fa4:.2f}x)" if fa4 else f"{v:.0f}"))
        lines.append(f"| d={d} {'causal' if c else 'full'} {s // 1024}k | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
