"""Tile schedulers on the GPU: static grid vs LPT (forward), sorted vs given batch order (varlen),
SPT vs naive (deterministic backward). Stage 5's device half, measured.

    python -m benchmarks.bench_sched --out benchmarks/results/sched_h200.json [--quick]

Three sections, each skipped with a message when the kernel it needs is not importable:

1. fixed-length causal forward, bf16, d = 128: MHA (batch 4 x 16 heads x 8k) and MQA-8 (batch 4 x
   8 query heads on 1 KV head x 8k). Stage 3's step 3 and the production forward with the static
   grid, ``LPTCausalScheduler.from_problem`` (sections sized for L2), and two ablations on MHA:
   LPT with sections of one head and ``LPTNoSectionsScheduler`` (the L2-thrashing order).
2. skewed varlen causal forward (the production varlen kernel + ``batch_map``): a few 8k-16k prefills
   after many short sequences, and short prefills followed by long-context requests (256 queries
   over 32k-64k keys). Static grid, LPT without the sort, LPT with ``VarlenSchedule`` (sorted),
   and the sort alone; plus the preprocessing kernel's own time.
3. deterministic causal backward (stage 4's step 1, whose dQ order is a parameter): K/V blocks
   ascending (naive), descending (SPT, head sections of one) and ``SPTBackwardOrder`` with L2
   sections, against the atomic (not deterministic) backward.

Every variant's output is compared with the static one bit for bit (the forward schedulers only
reorder tiles, so the bits must not change; deterministic backward variants are compared run to
run). Timing: triton.testing.do_bench median, two interleaved rounds (A B C A B C) so clock drift
hits every variant alike; reported ms = mean of the two medians, both kept in the JSON. The
simulator's prediction (stage5_scheduling.simulator, same problem, 132 SMs) is printed next to
each measured speedup. Writes JSON (device, versions, commit, source digest, results) and prints a
markdown table last.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import json
import math
import os
import platform
import sys
import time
import traceback

import numpy as np
import torch

from .bench_fwd import source_commit, source_digest, visible_pairs

PRODUCTION_FORWARD = "stage3_fwd_kernel.hopper"


def timer(rep_ms: int):
    try:
        from triton.testing import do_bench

        return (lambda fn: do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"),
                f"triton.testing.do_bench median (rep={rep_ms} ms), 2 interleaved rounds")
    except ImportError:
        from stage3_fwd_kernel.runner import benchmark_ms

        return (lambda fn: benchmark_ms(fn, warmup=5, iters=30)), "CUDA events median of 30, 2 interleaved rounds"


def versions():
    v = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    for pkg in ("nvidia-cutlass-dsl", "triton"):
        try:
            from importlib.metadata import version

            v[pkg] = version(pkg)
        except Exception:
            v[pkg] = None
    return v


def _import(name):
    try:
        return importlib.import_module(name), None
    except Exception as exc:  # noqa: BLE001 - report and skip, never crash the whole run
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]


def _err(exc):
    if os.environ.get("BENCH_TRACEBACK"):
        traceback.print_exc()
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]


def measure(bench, variants: dict, rounds: int = 2) -> dict:
    """name -> [ms per round], rounds interleaved across variants."""
    times = {n: [] for n in variants}
    for _ in range(rounds):
        for n, fn in variants.items():
            times[n].append(bench(fn))
    return times


def causal_flops_fixed(b, h, s, d):
    return 4.0 * b * h * s * s * d / 2  # as benchmarks.bench_fwd.flops: 4 b h s^2 d, halved for causal


def simulate_speedups(problem, orders_by_variant: dict, base: str, **kw) -> dict:
    """Simulated makespan ratio base / variant (132 SMs, H100 L2 model) for the named orders."""
    from stage5_scheduling import simulator as sim

    out = {}
    try:
        spans = {o: sim.run_forward(problem, o, l2=problem.l2(), **kw).makespan
                 for o in set(orders_by_variant.values()) if o}
        for v, o in orders_by_variant.items():
            if o:
                out[v] = spans[orders_by_variant[base]] / spans[o]
    except Exception as exc:  # noqa: BLE001
        print(f"  (simulation failed: {_err(exc)})")
    return out


# ---------------------------------------------------------------------------------------------
# 1. fixed-length causal forward
# ---------------------------------------------------------------------------------------------
def section_fixed(bench, quick: bool) -> list:
    from stage3_fwd_kernel.tile_scheduler import StaticTileScheduler
    from stage5_scheduling import device as dev
    from stage5_scheduling import simulator as sim

    fwd, why_fwd = _import(PRODUCTION_FORWARD)
    if fwd is None:
        print(f"  the production forward is not importable ({why_fwd}): measuring step 3 only")
    configs = [("mha b4 h16 8k", 4, 16, 16, 8192), ("mqa8 b4 h8/1 8k", 4, 8, 1, 8192)]
    rows = []
    for name, b, h, hkv, s in configs:
        d = 128
        lpt = dev.LPTCausalScheduler.from_problem(s, d, h, hkv)
        scheds = {"static": StaticTileScheduler, f"lpt S={lpt.heads_per_section}": lpt}
        sim_orders = {"static": "naive", f"lpt S={lpt.heads_per_section}": "lpt_causal"}
        sim_kw = {"heads_per_section": lpt.heads_per_section}
        if hkv == h and not quick:
            scheds["lpt S=1"] = dev.LPTCausalScheduler(1)
            scheds["lpt no sections"] = dev.LPTNoSectionsScheduler()
            sim_orders["lpt no sections"] = "lpt_no_sections"
        problem = sim.Problem.fixed(b, h, s, heads_kv=hkv)
        predicted = simulate_speedups(problem, sim_orders, "static", **sim_kw)
        if "lpt S=1" in scheds:
            one = simulate_speedups(problem, {"static": "naive", "lpt S=1": "lpt_causal"}, "static",
                                    heads_per_section=1)
            predicted.update(one)
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
        steps = {"step3": lambda sch: dev.step3_forward(q, k, v, causal=True, scheduler=sch)}
        if fwd is not None:
            # one CTA per tile: the orders as the hardware's dispatcher walks them (the simulated
            # greedy schedule), not through the production kernel's persistent CTAs
            kw4 = {"persistent": False} if "persistent" in inspect.signature(fwd.attention_forward).parameters else {}
            steps["production"] = lambda sch: fwd.attention_forward(q, k, v, causal=True, scheduler=sch, **kw4)
        for step, run in steps.items():
            variants, meta = {}, {}
            ref = None
            for sname, sch in scheds.items():
                row = {"section": "fwd_fixed", "config": name, "impl": step, "scheduler": sname, "batch": b,
                       "heads": h, "heads_kv": hkv, "seqlen": s, "head_dim": d}
                try:
                    t0 = time.time()
                    out, lse = run(sch)
                    torch.cuda.synchronize()
                    row["first_call_s"] = round(time.time() - t0, 2)
                    if ref is None:
                        ref = (out.clone(), lse.clone())
                    row["bitwise_equal_static"] = bool(torch.equal(out, ref[0]) and torch.equal(lse, ref[1]))
                    variants[sname] = (lambda sch=sch, run=run: run(sch))
                except Exception as exc:  # noqa: BLE001
                    row["error"] = _err(exc)
                meta[sname] = row
            times = measure(bench, variants)
            base = float(np.mean(times["static"])) if "static" in times else None
            for sname, row in meta.items():
                if sname in times:
                    ms = float(np.mean(times[sname]))
                    row.update(ms=ms, ms_rounds=times[sname], tflops=causal_flops_fixed(b, h, s, d) / ms / 1e9)
                    if base:
                        row["speedup_vs_static"] = base / ms
                if sname in predicted:
                    row["sim_speedup_vs_static"] = predicted[sname]
                rows.append(row)
                _print_row(row)
    return rows


# ---------------------------------------------------------------------------------------------
# 2. skewed varlen causal forward (the production varlen kernel + batch_map)
# ---------------------------------------------------------------------------------------------
def varlen_configs(quick: bool):
    rng = np.random.default_rng(0)
    short = rng.integers(128, 1025, size=56).tolist()
    prefills_last = (short + [8192, 12288, 16384], None)  # q == k
    squares = rng.integers(512, 4097, size=24).tolist()
    long_k = [32768, 40960, 49152, 65536]
    long_context_last = (squares + [256] * 4, squares + long_k)
    cfgs = [("prefills last: 56 short + 8k/12k/16k", *prefills_last)]
    if not quick:
        cfgs.append(("24 prefills, then 4 x 256q over 32k-64k keys", *long_context_last))
    return cfgs


def section_varlen(bench, quick: bool) -> list:
    fwd, why = _import(PRODUCTION_FORWARD)
    if fwd is None or "batch_map" not in inspect.signature(fwd.attention_varlen_forward).parameters:
        msg = why or "attention_varlen_forward has no batch_map"
        print(f"  SKIP varlen section: needs the production varlen forward with batch_map ({msg})")
        return [{"section": "fwd_varlen", "skipped": f"production varlen + batch_map unavailable: {msg}"}]
    from stage3_fwd_kernel.tile_scheduler import StaticTileScheduler
    from stage5_scheduling import device as dev
    from stage5_scheduling import metadata as md
    from stage5_scheduling import simulator as sim

    H, d = 16, 128
    rows = []
    for name, lens_q, lens_k in varlen_configs(quick):
        print(f"  {name}: {len(lens_q)} sequences")
        lens_k = lens_q if lens_k is None else lens_k
        cu_q = torch.tensor(np.concatenate([[0], np.cumsum(lens_q)]), dtype=torch.int32, device="cuda")
        cu_k = torch.tensor(np.concatenate([[0], np.cumsum(lens_k)]), dtype=torch.int32, device="cuda")
        max_q, max_k = max(lens_q), max(lens_k)
        g = torch.Generator(device="cuda").manual_seed(1)
        q = torch.randn(int(cu_q[-1]), H, d, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(int(cu_k[-1]), H, d, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(int(cu_k[-1]), H, d, device="cuda", dtype=torch.bfloat16, generator=g)
        flops = 4.0 * d * H * sum(visible_pairs(a, c, None, None, True) for a, c in zip(lens_q, lens_k))
        # the production grid is padded: (ceil(max_q / tile_m), H, B) CTAs, of which only the real tiles work
        tm = fwd.default_tile_m(d, d)
        grid_ctas = math.ceil(max_q / tm) * H * len(lens_q)
        real_tiles = H * sum(math.ceil(a / tm) for a in lens_q)
        sched = md.VarlenSchedule(cu_q, cu_k, H, max_seqlen_k=max_k, tile_m=tm, tile_n=fwd.default_tile_n(d, d))
        S = sched.heads_per_section
        lpt = dev.LPTCausalScheduler(S)
        variants_args = {
            "static (given order)": dict(scheduler=StaticTileScheduler),
            "static + sort": dict(scheduler=StaticTileScheduler, batch_map=sched.batch_map),
            f"lpt S={S}, no sort": dict(scheduler=lpt),
            f"lpt S={S} + sort": sched.step4_kwargs(),
        }
        problem = sim.Problem.varlen(lens_q, H, lens_k)
        predicted = simulate_speedups(problem, {"static (given order)": "naive", f"lpt S={S}, no sort": "lpt_unsorted",
                                                f"lpt S={S} + sort": "lpt_varlen"}, "static (given order)",
                                      heads_per_section=S)

        def run(kw):
            return fwd.attention_varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, **kw)
        variants, meta, ref = {}, {}, None
        for vname, kw in variants_args.items():
            row = {"section": "fwd_varlen", "config": name, "impl": "production varlen", "scheduler": vname,
                   "batch": len(lens_q), "heads": H, "head_dim": d, "total_q": int(cu_q[-1]), "total_k": int(cu_k[-1]),
                   "grid_ctas": grid_ctas, "real_tiles": real_tiles}
            try:
                t0 = time.time()
                out, lse = run(kw)
                torch.cuda.synchronize()
                row["first_call_s"] = round(time.time() - t0, 2)
                if ref is None:
                    ref = (out.clone(), lse.clone())
                row["bitwise_equal_static"] = bool(torch.equal(out, ref[0]) and torch.equal(lse, ref[1]))
                variants[vname] = (lambda kw=kw: run(kw))
            except Exception as exc:  # noqa: BLE001
                row["error"] = _err(exc)
            meta[vname] = row
        # the preprocessing kernel itself (paid once per batch layout, not per layer)
        variants["metadata kernel (once per layout)"] = lambda: md.varlen_metadata_device(
            cu_q, cu_k, H, tile_n=fwd.default_tile_n(d, d))
        meta["metadata kernel (once per layout)"] = {"section": "fwd_varlen", "config": name, "impl": "stage5 metadata",
                                                      "scheduler": "sort (1 CTA)", "batch": len(lens_q)}
        times = measure(bench, variants)
        base = float(np.mean(times["static (given order)"])) if "static (given order)" in times else None
        for vname, row in meta.items():
            if vname in times:
                ms = float(np.mean(times[vname]))
                row.update(ms=ms, ms_rounds=times[vname])
                if row["impl"] != "stage5 metadata":
                    row["tflops"] = flops / ms / 1e9
                    row["flops_note"] = "exact unmasked (q, k) pairs x 4 d H"
                    if base:
                        row["speedup_vs_static"] = base / ms
            if vname in predicted:
                row["sim_speedup_vs_static"] = predicted[vname]
            rows.append(row)
            _print_row(row)
    return rows


# ---------------------------------------------------------------------------------------------
# 3. deterministic causal backward (stage 4)
# ---------------------------------------------------------------------------------------------
def section_bwd(bench, quick: bool) -> list:
    bwd, why = _import("stage4_bwd_kernel.hopper_step1")
    sched_mod, why2 = _import("stage4_bwd_kernel.schedule")
    if bwd is None or sched_mod is None:
        msg = why or why2
        print(f"  SKIP backward section: stage 4's Hopper backward is not importable ({msg})")
        return [{"section": "bwd_deterministic", "skipped": f"stage 4 unavailable: {msg}"}]
    from stage5_scheduling import device as dev
    from stage5_scheduling import simulator as sim

    b, h, s, d = (2, 16, 4096, 128) if quick else (2, 16, 8192, 128)
    S = dev.LPTCausalScheduler.from_problem(s, d, h).heads_per_section
    swizzle_live = "tile_for_launch" in inspect.getsource(bwd)
    orders_ = {
        "atomic (not deterministic)": (False, None),
        "det. naive (n ascending)": (True, sched_mod.KVAscendingOrder),
        "det. SPT (n descending)": (True, sched_mod.KVDescendingOrder),
        f"det. SPT S={S}" + ("" if swizzle_live else " (swizzle inert)"): (True, dev.SPTBackwardOrder(S)),
    }
    tile_m = 64  # stage 4 step 1 at d = 128: tile_m 64, tile_n 128
    problem = sim.Problem.fixed(b, h, s, tile_m=tile_m)
    predicted = {}
    try:
        spans = {"det. naive (n ascending)": sim.run_backward(problem, "naive_bwd").makespan,
                 "det. SPT (n descending)": sim.run_backward(problem, "spt_bwd", heads_per_section=1).makespan}
        if swizzle_live:
            spans[f"det. SPT S={S}"] = sim.run_backward(problem, "spt_bwd", heads_per_section=S).makespan
        predicted = {k: spans["det. naive (n ascending)"] / v for k, v in spans.items()}
    except Exception as exc:  # noqa: BLE001
        print(f"  (simulation failed: {_err(exc)})")
    from stage5_scheduling.device import step3_forward

    g = torch.Generator(device="cuda").manual_seed(2)
    q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    out, lse = step3_forward(q, k, v, causal=True)
    flops = 2.5 * causal_flops_fixed(b, h, s, d)
    name = f"causal b{b} h{h} {s // 1024}k d{d}"

    def run(det, order):
        return bwd.attention_backward(q, k, v, out, dout, lse, causal=True, deterministic=det, dq_order=order)
    variants, meta = {}, {}
    for vname, (det, order) in orders_.items():
        row = {"section": "bwd_deterministic", "config": name, "impl": "stage4 hopper_step1", "scheduler": vname,
               "batch": b, "heads": h, "seqlen": s, "head_dim": d, "deterministic": det}
        try:
            t0 = time.time()
            first = run(det, order)
            torch.cuda.synchronize()
            row["first_call_s"] = round(time.time() - t0, 2)
            if det:
                again = run(det, order)
                row["run_to_run_bitwise"] = all(torch.equal(x, y) for x, y in zip(first, again))
            variants[vname] = (lambda det=det, order=order: run(det, order))
        except Exception as exc:  # noqa: BLE001
            row["error"] = _err(exc)
        meta[vname] = row
    times = measure(bench, variants)
    base = float(np.mean(times["det. naive (n ascending)"])) if "det. naive (n ascending)" in times else None
    rows = []
    for vname, row in meta.items():
        if vname in times:
            ms = float(np.mean(times[vname]))
            row.update(ms=ms, ms_rounds=times[vname], tflops=flops / ms / 1e9)
            if base:
                row["speedup_vs_naive_det"] = base / ms
        key = vname.replace(" (swizzle inert)", "")
        if key in predicted:
            row["sim_speedup_vs_naive_det"] = predicted[key]
        rows.append(row)
        _print_row(row)
    return rows


# ---------------------------------------------------------------------------------------------
def _print_row(r):
    if "skipped" in r:
        print(f"  {r['section']}: skipped ({r['skipped']})")
        return
    shown = f"{r['ms']:8.3f} ms" if "ms" in r else f"ERROR {r.get('error', '')[:90]}"
    tf = f" {r['tflops']:6.1f} TFLOP/s" if "tflops" in r else ""
    sp = r.get("speedup_vs_static", r.get("speedup_vs_naive_det"))
    sp = f"  x{sp:.3f}" if sp else ""
    print(f"  [{r['config']}] {r['impl']:16} {r['scheduler']:34} {shown}{tf}{sp}", flush=True)


def summary_table(doc) -> str:
    lines = ["| section | config | kernel | order | ms | TFLOP/s | speedup | simulated | bits |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in doc["results"]:
        if "skipped" in r:
            lines.append(f"| {r['section']} | skipped: {r['skipped']} | | | | | | | |")
            continue
        ms = f"{r['ms']:.3f}" if "ms" in r else "error"
        tf = f"{r['tflops']:.0f}" if "tflops" in r else "-"
        sp = r.get("speedup_vs_static", r.get("speedup_vs_naive_det"))
        sim_ = r.get("sim_speedup_vs_static", r.get("sim_speedup_vs_naive_det"))
        bits = r.get("bitwise_equal_static", r.get("run_to_run_bitwise"))
        bits = "-" if bits is None else ("same" if bits else "DIFFER")
        lines.append(f"| {r['section']} | {r['config']} | {r['impl']} | {r['scheduler']} | {ms} | {tf} | "
                     f"{f'{sp:.3f}x' if sp else '-'} | {f'{sim_:.3f}x' if sim_ else '-'} | {bits} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="no ablations, one varlen batch, 4k backward")
    ap.add_argument("--sections", default="fixed,varlen,bwd")
    ap.add_argument("--rep-ms", type=int, default=150, help="do_bench time budget per measurement")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_sched needs a CUDA GPU")
        return 2
    bench, timing = timer(args.rep_ms)
    t0 = time.time()
    print(f"device {torch.cuda.get_device_name()}  ({timing})")
    results = []
    for sec, fn in (("fixed", section_fixed), ("varlen", section_varlen), ("bwd", section_bwd)):
        if sec not in args.sections.split(","):
            continue
        print(f"== {sec} ({time.time() - t0:.0f} s)", flush=True)
        try:
            results += fn(bench, args.quick)
        except Exception as exc:  # noqa: BLE001
            results.append({"section": sec, "skipped": f"crashed: {_err(exc)}"})
            print(f"  section {sec} crashed: {results[-1]['skipped']}")
        torch.cuda.empty_cache()
    doc = {"device": torch.cuda.get_device_name(), "sms": torch.cuda.get_device_properties(0).multi_processor_count,
           "versions": versions(), "git_commit": source_commit(), "source_digest": source_digest(), "timing": timing,
           "dtype": "bf16", "quick": args.quick, "elapsed_s": round(time.time() - t0, 1),
           "command": "python -m benchmarks.bench_sched " + " ".join(argv if argv is not None else sys.argv[1:]),
           "results": results}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {args.out} ({doc['elapsed_s']} s)")
    print(summary_table(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
