"""Stage 2, part 5: how many exp2 per clock an SM delivers with MUFU, emulation, and mixes.

Compared with gpu_kernel.py, which streams a tensor through exp2 (memory bound: 8 bytes per
result, ~3.3 TB/s -> ~0.4 T results/s, far below either unit), this adds a compute-bound
microbenchmark because the question "what fraction should we emulate?" is about issue slots
and pipes, not bytes. Each thread keeps a softmax row of G = 20 scores in registers and loops:

    m   = m + dm                       (the running max moves, so nothing can be hoisted)
    t_i = fma(s_i, scale, m)           FFMA      x * scale - max, as the softmax does
    e_i = exp2(t_i)                    MUFU.EX2, or the emulated sequence (8 instr at degree 3)
    l_i = l_i + e_i                    FADD      the row sum

and writes sum_i l_i at the end, so no work is dead. A variant emulates k of the G values
(k = 0, 2, 4, 5, ..., 20; spread evenly over the row like FA4's partial emulation).

Expected (H100, per SM sub-partition = SMSP, 4 per SM; one warp instruction issued per clock):
    MUFU:   4 lanes / clk / SMSP -> a warp's MUFU.EX2 occupies the unit 8 clocks (16 / clk / SM)
    issue:  1 warp instruction / clk / SMSP; FP32 FMA pipe 32 lanes, so FFMA/FADD issue-bound
    ALU:    16 lanes / clk / SMSP -> FMNMX and LEA cost 2 clocks of the ALU pipe each

Per warp and element, with w = 2 softmax ops (FFMA + FADD) and n_e = 5 + degree emulation
instructions, a fraction e emulated costs
    issue = (1 - e)(1 + w) + e (n_e + w)        MUFU pipe = 8 (1 - e)
and the SM delivers 4 * 32 / max(issue, MUFU pipe) results per clock. MUFU alone: 16 / clk.
Emulation alone at degree 3: issue = 10 -> 12.8 / clk (worse than MUFU). The two balance at
e* = (7 - w) / (n_e + 7) = 5 / 15 = 33% for degree 3, giving 128 / 5.33 = 24 / clk (1.5x).
Degree 5: e* = 5 / 17 = 29%, 22.6 / clk. A real softmax adds the row max (FMNMX) and the bf16
pack (F2FP, half an instruction per value), w ~ 3.5, which pulls e* to ~ 23% (3.5 / 15).
`model_rate` computes this; the benchmark measures it.

Method: events time each launch; inside the kernel thread 0 of every CTA stamps %clock64 and
%globaltimer at start and end. SM clock f = median over CTAs of d(clock64) / d(globaltimer)
(the clock the SM actually ran at, under whatever boost/power state the card is in). Then
    results / clk / SM = results / (num_SMs * window_ns * f)
with window = last end - first start over all CTAs (globaltimer is chip-wide). One wave only:
the grid is num_SMs * CTAs-per-SM, sized from the register count ptxas reports, and the
start spread is reported so a second wave would show.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

from . import gpu_kernel as gk
from .gpu_kernel import cuda, cute, cutlass, ex2_approx_f32, exp2_emulated_f32, fma_rn_f32
from cutlass import Float32, Int32, Int64

__all__ = ["G", "VARIANTS", "bench_compile_only", "main", "model_rate", "run_bench"]

G = 20  # scores per thread: 20 divides into 10%, 25%, 50% exactly (2, 5, 10 of 20)
THREADS = 256
REG_FILE = 65536  # 32-bit registers per SM (sm_90)
MAX_WARPS_PER_SM = 64
MUFU_PER_CLK_SMSP = 4
W_SOFTMAX = 2  # FFMA (scale, -max) + FADD (row sum) per element in this benchmark


def _pattern(n_emulated: int) -> tuple:
    """Which of the G values are emulated: k of them spread evenly (Bresenham)."""
    return tuple((i + 1) * n_emulated // G > i * n_emulated // G for i in range(G))


# name, work ("exp" or "fma_only"), number emulated of G, degree
VARIANTS = [
    ("fma_only", "fma_only", 0, 3),
    ("mufu", "exp", 0, 3),
    ("emu10_d3", "exp", 2, 3),
    ("emu20_d3", "exp", 4, 3),
    ("emu25_d3", "exp", 5, 3),
    ("emu30_d3", "exp", 6, 3),
    ("emu35_d3", "exp", 7, 3),
    ("emu40_d3", "exp", 8, 3),
    ("emu50_d3", "exp", 10, 3),
    ("emu100_d3", "exp", 20, 3),
    ("emu25_d5", "exp", 5, 5),
    ("emu100_d5", "exp", 20, 5),
]


def model_rate(fraction: float, degree: int = 3, w: float = W_SOFTMAX) -> float:
    """Predicted exp2 results / clk / SM on sm_90 (issue- vs MUFU-bound, see the docstring)."""
    n_e = 5 + degree
    issue = (1 - fraction) * (1 + w) + fraction * (n_e + w)
    mufu = (1 - fraction) * 32 / MUFU_PER_CLK_SMSP
    alu = fraction * 2 * 2  # FMNMX + LEA at 16 lanes / clk
    return 4 * 32 / max(issue, mufu, alu)


# ----------------------------------------------------------------------------------------
# The kernel
# ----------------------------------------------------------------------------------------
@cute.kernel
def bench_kernel(
    mOut: cute.Tensor,  # (num_threads,) one row sum per thread
    mClk: cute.Tensor,  # (num_ctas * 4,) clock64 start/end, globaltimer start/end
    n_iter: Int32,
    scale: Float32,
    neg_max: Float32,
    d_max: Float32,
    pattern: cutlass.Constexpr,  # G bools: True = emulated
    coefficients: cutlass.Constexpr,
    work: cutlass.Constexpr,  # "exp" or "fma_only"
):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    gtid = bidx * THREADS + tidx

    # 1. a row of G scores in registers, distinct per thread, in [0, 16): with scale = 1 and
    #    max = 16 the exponents t span [-16, 0], as in a softmax
    tSrS = cute.make_rmem_tensor((G,), Float32)  # scores
    tSrL = cute.make_rmem_tensor((G,), Float32)  # row-sum partials (one chain per value)
    base = Float32(gtid % 4093) * Float32(0.0003)
    for i in cutlass.range_constexpr(G):
        tSrS[i] = base + Float32(0.77 * i)
        tSrL[i] = Float32(0.0)

    # 2. start stamps (every thread reads; thread 0 writes)
    clk0 = cute.arch.clock64()
    ns0 = cute.arch.globaltimer()

    # 3. mainloop: per element one FFMA, one exp2, one FADD
    m = neg_max
    for _ in cutlass.range(n_iter, unroll=2):
        m = m + d_max
        for i in cutlass.range_constexpr(G):
            t = fma_rn_f32(tSrS[i], scale, m)
            if cutlass.const_expr(work == "fma_only"):
                tSrL[i] = tSrL[i] + t
            elif cutlass.const_expr(pattern[i]):
                tSrL[i] = tSrL[i] + exp2_emulated_f32(t, coefficients)
            else:
                tSrL[i] = tSrL[i] + ex2_approx_f32(t)

    # 4. end stamps and the output (keeps every result alive)
    clk1 = cute.arch.clock64()
    ns1 = cute.arch.globaltimer()
    total = Float32(0.0)
    for i in cutlass.range_constexpr(G):
        total = total + tSrL[i]
    mOut[gtid] = total
    if tidx == 0:
        mClk[bidx * 4 + 0] = clk0
        mClk[bidx * 4 + 1] = clk1
        mClk[bidx * 4 + 2] = ns0
        mClk[bidx * 4 + 3] = ns1


@cute.jit
def bench_launch(
    ptr_out: cute.Pointer,
    ptr_clk: cute.Pointer,
    num_ctas: Int32,
    n_iter: Int32,
    scale: Float32,
    neg_max: Float32,
    d_max: Float32,
    stream: cuda.CUstream,
    pattern: cutlass.Constexpr,
    coefficients: cutlass.Constexpr,
    work: cutlass.Constexpr,
):
    mOut = cute.make_tensor(ptr_out, cute.make_layout(num_ctas * THREADS))
    mClk = cute.make_tensor(ptr_clk, cute.make_layout(num_ctas * 4))
    bench_kernel(mOut, mClk, n_iter, scale, neg_max, d_max, pattern, coefficients, work).launch(
        grid=[num_ctas, 1, 1], block=[THREADS, 1, 1], stream=stream
    )


def _fake_args():
    from cutlass.cute.runtime import make_fake_stream, make_ptr

    return (
        make_ptr(Float32, 0, cute.AddressSpace.gmem, assumed_align=16),
        make_ptr(Int64, 0, cute.AddressSpace.gmem, assumed_align=16),
        Int32(1), Int32(1), Float32(1.0), Float32(-16.0), Float32(0.0),
        make_fake_stream(),
    )


def _variant_constexprs(work: str, n_emulated: int, degree: int) -> tuple:
    coeffs = gk._resolve("emulated", degree, None)
    return _pattern(n_emulated), coeffs, work


def _compile_variant(work, n_emulated, degree, *, arch=None, keep_dir=None):
    args = (*_fake_args(), *_variant_constexprs(work, n_emulated, degree))
    return gk._compile(bench_launch, args, arch=arch, keep_dir=keep_dir)


def bench_compile_only(arch: str = "sm_90a", names=None) -> dict:
    """{variant: {"sass", "resources"}} for `arch`, without a GPU."""
    out = {}
    for name, work, k, degree in VARIANTS:
        if names is not None and name not in names:
            continue
        with tempfile.TemporaryDirectory() as keep_dir:
            c = _compile_variant(work, k, degree, arch=arch, keep_dir=keep_dir)
            out[name] = {"sass": gk.sass_from_cubin(c.__cubin__),
                         "resources": gk.kernel_resources(c.__cubin__)}
    return out


# ----------------------------------------------------------------------------------------
# Running it
# ----------------------------------------------------------------------------------------
def _ctas_per_sm(registers: int) -> int:
    """Resident 256-thread CTAs per SM from the register count (256-register warp granules)."""
    per_warp = math.ceil(registers * 32 / 256) * 256
    warps = min(REG_FILE // per_warp, MAX_WARPS_PER_SM)
    return max(1, warps // (THREADS // 32))


def _nvidia_smi_clocks() -> dict:
    q = "clocks.sm,clocks.max.sm,clocks.applications.graphics,power.draw,temperature.gpu"
    try:
        r = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=10)
        return {"query": q, "value": r.stdout.strip()}
    except Exception as exc:  # not fatal: the in-kernel clock is the primary source
        return {"query": q, "error": repr(exc)}


def run_bench(n_iter: int = 8192, reps: int = 5, names=None, log=print) -> dict:
    import torch
    from cutlass.cute.runtime import make_ptr

    dev = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(dev)
    num_sms = props.multi_processor_count
    results = []
    for name, work, k, degree in VARIANTS:
        if names is not None and name not in names:
            continue
        with tempfile.TemporaryDirectory() as keep_dir:
            t0 = time.time()
            compiled = _compile_variant(work, k, degree, keep_dir=keep_dir)
            compile_s = time.time() - t0
            res = gk.kernel_resources(compiled.__cubin__)
        regs = max(r["registers"] for r in res.values())
        ctas = num_sms * _ctas_per_sm(regs)
        out = torch.empty(ctas * THREADS, dtype=torch.float32, device="cuda")
        clk = torch.zeros(ctas * 4, dtype=torch.int64, device="cuda")
        args = (
            make_ptr(Float32, out.data_ptr(), cute.AddressSpace.gmem, assumed_align=16),
            make_ptr(Int64, clk.data_ptr(), cute.AddressSpace.gmem, assumed_align=16),
            # scale 1, max 16, and a max that drifts by -1e-5 per trip (~5 ulp at 16; 0.16
            # over 16k trips): the exponents stay in [-16.2, 0], none repeats exactly
            Int32(ctas), Int32(n_iter), Float32(1.0), Float32(-16.0), Float32(-1e-5),
            gk._stream_of_current_torch_stream(),
        )
        compiled(*args)  # warm-up (module load)
        torch.cuda.synchronize()
        n_results = ctas * THREADS * n_iter * G
        runs = []
        for _ in range(reps):
            out.fill_(float("nan"))
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            compiled(*args)
            end.record()
            torch.cuda.synchronize()
            c = clk.view(ctas, 4).cpu()
            d_clk = (c[:, 1] - c[:, 0]).double()
            d_ns = (c[:, 3] - c[:, 2]).double()
            f_ghz = float((d_clk / d_ns).median())
            window_ns = float(c[:, 3].max() - c[:, 2].min())
            start_spread_ns = float(c[:, 2].max() - c[:, 2].min())
            one_wave = start_spread_ns < 0.1 * window_ns  # else some CTAs waited for a slot
            event_ms = start.elapsed_time(end)
            runs.append({
                "event_ms": event_ms,
                "window_ns": window_ns,
                "sm_clock_ghz": f_ghz,
                "start_spread_ns": start_spread_ns,
                "one_wave": one_wave,
                "per_clk_per_sm": n_results / (num_sms * window_ns * f_ghz),
                "per_clk_per_sm_events": n_results / (num_sms * event_ms * 1e6 * f_ghz),
                "finite_output": bool(torch.isfinite(out).all()),
            })
        best = statistics.median(r["per_clk_per_sm"] for r in runs)
        frac = k / G if work == "exp" else None
        entry = {
            "name": name, "work": work, "emulated": k, "of": G, "fraction": frac,
            "degree": degree, "registers": regs, "ctas": ctas, "threads": ctas * THREADS,
            "n_iter": n_iter, "compile_s": round(compile_s, 2),
            "median_per_clk_per_sm": best,
            "model_per_clk_per_sm": model_rate(frac, degree) if frac is not None else None,
            "runs": runs,
        }
        results.append(entry)
        model = f"{entry['model_per_clk_per_sm']:.1f}" if frac is not None else "-"
        log(f"  {name:10s} regs={regs:3d} ctas={ctas:4d} "
            f"f={statistics.median(r['sm_clock_ghz'] for r in runs):.3f} GHz "
            f"exp2/clk/SM={best:6.2f} (model {model})")
    clocks = [run["sm_clock_ghz"] for r in results for run in r["runs"]]
    return {"num_sms": num_sms,
            "clocks": {"sm_clock_ghz_median": statistics.median(clocks) if clocks else None,
                       "sm_clock_ghz_min": min(clocks, default=None),
                       "sm_clock_ghz_max": max(clocks, default=None),
                       "source": "in-kernel d(%clock64) / d(%globaltimer), thread 0 per CTA"},
            "results": results}


def git_commit() -> str:
    """The commit the measured code came from. A GPU machine may get a copy of the working
    tree without usable git history, so the caller passes it in FA4_GIT_COMMIT."""
    commit = os.environ.get("FA4_GIT_COMMIT", "")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                    cwd=os.path.dirname(__file__), timeout=10).stdout.strip()
        except Exception:
            commit = ""
    is_hash = len(commit) >= 7 and all(c in "0123456789abcdef" for c in commit.lower())
    return commit if is_hash else ""


def environment() -> dict:
    import torch

    commit = git_commit()
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {
        "device": props.name,
        "capability": list(torch.cuda.get_device_capability()),
        "num_sms": props.multi_processor_count,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cutlass_dsl": getattr(cutlass, "__version__", "?"),
        "arch": gk.ARCH,
        "git_commit": commit or "unknown (not committed yet)",
        "python": sys.version.split()[0],
        "clocks_nvidia_smi": _nvidia_smi_clocks(),
    }


def bench_document(env: dict, bench: dict) -> dict:
    """The JSON written for a benchmark run: who/where at the top, then clocks and results."""
    return {"device": env.get("device"), "torch": env.get("torch"),
            "cutlass_dsl": env.get("cutlass_dsl"), "git_commit": env.get("git_commit"),
            "environment": env, "method": __doc__.split("Method:")[1].strip(),
            "model": {"w_softmax": W_SOFTMAX, "mufu_lanes_per_smsp": MUFU_PER_CLK_SMSP,
                      "emulation_instructions": "5 + degree (FMNMX, FADD.RM, 2 FADD, "
                                                "degree FFMA, LEA)"},
            **bench}


def summarize(results: list) -> str:
    lines = ["| variant | emulated | degree | exp2 / clk / SM (measured) | model | vs MUFU |",
             "|---|---|---|---|---|---|"]
    mufu = next((r["median_per_clk_per_sm"] for r in results if r["name"] == "mufu"), None)
    for r in results:
        frac = "-" if r["fraction"] is None else f"{100 * r['fraction']:.0f}%"
        model = "-" if r["model_per_clk_per_sm"] is None else f"{r['model_per_clk_per_sm']:.1f}"
        ratio = "-" if not mufu else f"{r['median_per_clk_per_sm'] / mufu:.2f}x"
        lines.append(f"| {r['name']} | {frac} | {r['degree']} | "
                     f"{r['median_per_clk_per_sm']:.2f} | {model} | {ratio} |")
    exp_rows = [r for r in results if r["work"] == "exp" and r["degree"] == 3]
    if exp_rows:
        best = max(exp_rows, key=lambda r: r["median_per_clk_per_sm"])
        e_star = max((k / 100 for k in range(101)), key=model_rate)
        lines.append(f"\nbest degree-3 mix measured: {100 * best['fraction']:.0f}% emulated, "
                     f"{best['median_per_clk_per_sm']:.2f} exp2/clk/SM; model optimum "
                     f"{100 * e_star:.0f}% at {model_rate(e_star):.1f}")
    if any(not run["one_wave"] for r in results for run in r["runs"]):
        lines.append("WARNING: some runs were not a single wave (CTA start spread > 10% of "
                     "the window): the per-SM numbers of those runs are low")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--n-iter", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():  # compile-only: what ptxas made of each variant
        print("no GPU: compile-only report (sm_90a); instructions per value in the hot loop")
        for name, b in bench_compile_only("sm_90a").items():
            loop = gk.hot_loop_opcodes(b["sass"])
            res = next(iter(b["resources"].values()))
            work, k, deg = next((w, k, d) for n, w, k, d in VARIANTS if n == name)
            model = f"{model_rate(k / G, deg):5.1f}" if work == "exp" else "    -"
            print(f"  {name:10s} regs={res['registers']:3d} frame={res['frame_bytes']}B "
                  f"instr/value={len(loop) / (2 * G):5.2f} "
                  f"MUFU/value={loop.count('MUFU.EX2') / (2 * G):.2f} "
                  f"model={model} exp2/clk/SM")
        return 0
    doc = bench_document(environment(), run_bench(args.n_iter, args.reps))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(summarize(doc["results"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
