"""Stage 2 on the GPU: check, then measure. One entry point for a GPU machine.

    python -m stage2_emulated_exp.device_main --out $OUT

Compared with the CPU half of the lesson (host_model, accuracy), this adds the three facts
only a GPU can supply, in llm.c's "check, then time" order:

  1. bit-exactness: the emulated kernel equals host_model.exp2_emulated bit for bit on
     >= 16M inputs (random over [-130, 130], uniform [0, 1), random bit patterns over the
     whole float32 line, and structured points: integers, half-integers, +-1..4 ulp around
     integers, the -126/-127/-128 edges, +-0, subnormals, large x, +-inf, NaNs), for degrees
     3, 4, 5 with .ftz (the default) and without, and with the official FA4 degree-3
     coefficients. Any mismatch -> exit status 1.
  2. the MUFU.EX2 row of the accuracy table (paper: 1.41e-7 max / 3.04e-8 mean on [0, 1)).
  3. the throughput benchmark (gpu_bench): exp2 results per clock per SM, MUFU vs mixes.

Everything lands as JSON under --out; a readable summary goes to stdout (and summary.md).
Budget: ~25 compiles of ~1 s, host model on 16M points x 7 configs split over CPU threads
(NumPy releases the GIL), ~12 benchmark kernels of ~10 ms x 6 runs: well under 3 minutes.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import sys
import time
import traceback

import numpy as np

from . import gpu_kernel as gk

DEGREES = (3, 4, 5)
N_UNIFORM_WIDE = 10_000_000  # uniform over [-130, 130]
N_UNIFORM_01 = 4_000_000  # uniform over [0, 1): the polynomial's own interval
N_RANDOM_BITS = 2_000_000  # uniform uint32 patterns: every class of float32, NaNs included
CLASSES = ("structured", "uniform[-130,130]", "uniform[0,1)", "random_bits")


# ----------------------------------------------------------------------------------------
# 1. inputs
# ----------------------------------------------------------------------------------------
def _f32(a) -> np.ndarray:
    return np.asarray(a, dtype=np.float32).ravel()


def _bits(u) -> np.ndarray:
    return np.asarray(u, dtype=np.uint64).astype(np.uint32).view(np.float32)


def _ulp_walk(center: float, k: int) -> np.ndarray:
    """The 2k+1 consecutive float32 values around `center` (by bit pattern, crossing 0)."""
    c = np.float32(center)
    up, down = [c], [c]
    for _ in range(k):
        up.append(np.nextafter(up[-1], np.float32(np.inf)))
        down.append(np.nextafter(down[-1], np.float32(-np.inf)))
    return _f32(down[::-1] + up[1:])


def structured_points(rng: np.random.Generator) -> np.ndarray:
    """Hand-picked inputs where the sequence changes behaviour (see host_model's table)."""
    ints = np.arange(-300, 301, dtype=np.float32)
    parts = [
        ints,
        ints + np.float32(0.5),
        ints + np.float32(0.25),
        # +-1..4 ulp around every integer in [-140, 140]: the floor flips there
        np.concatenate([_ulp_walk(v, 4) for v in range(-140, 141)]),
        # the clamp and the exponent-field edges, walked densely
        np.concatenate([_ulp_walk(v, 2000) for v in (-126.0, -127.0, -128.0, -125.0)]),
        np.concatenate([_ulp_walk(v, 200) for v in (127.0, 128.0, 129.0, 1.0, -1.0)]),
        # zeros, subnormals (both signs), the smallest normals
        _f32([0.0, -0.0]),
        _bits(np.arange(1, 2001)), _bits(np.arange(1, 2001) | 0x80000000),
        _bits(rng.integers(1, 0x00800000, 20000)),
        _bits(rng.integers(1, 0x00800000, 20000) | 0x80000000),
        _ulp_walk(2.0**-126, 50), _ulp_walk(-(2.0**-126), 50),
        # (-1, 0): f = 1 + x rounds, possibly to 1.0
        -np.float32(2.0) ** -np.arange(1, 150, dtype=np.float32),
        _f32(rng.uniform(-1.0, 0.0, 50000)),
        _f32(-rng.uniform(0, 1, 20000) * np.float32(2.0**-20)),
        # large x: wrapping exponents, j leaving [2^23, 2^24), huge and overflowing values
        _f32(rng.uniform(128, 2.0**22, 20000)),
        np.concatenate([_ulp_walk(v, 20) for v in (2.0**22, 2.0**23, 2.0**24, 2.0**31)]),
        _f32([1e10, 1e20, 1e30, 3.4028235e38, -1e10, -1e30, -3.4028235e38]),
        _f32(-rng.uniform(128, 2.0**22, 20000)),
        # infinities and NaNs (quiet, signalling, negative, with payloads)
        _f32([np.inf, -np.inf]),
        _bits([0x7FC00000, 0x7FFFFFFF, 0xFFC00000, 0xFFFFFFFF, 0x7F800001, 0xFF800001,
               0x7FA00000, 0x7FC00001]),
    ]
    return np.concatenate([_f32(p) for p in parts])


def bitexact_inputs(scale: float = 1.0, seed: int = 0):
    """(x float32, class id uint8). scale=1 gives >= 16M points; tests use a smaller scale."""
    rng = np.random.default_rng(seed)
    groups = [
        structured_points(rng),
        _f32(rng.uniform(-130, 130, int(N_UNIFORM_WIDE * scale))),
        _f32(rng.random(int(N_UNIFORM_01 * scale), dtype=np.float32)),
        _bits(rng.integers(0, 2**32, int(N_RANDOM_BITS * scale), dtype=np.uint64)),
    ]
    x = np.concatenate(groups)
    cls = np.concatenate([np.full(len(g), i, dtype=np.uint8) for i, g in enumerate(groups)])
    return x, cls


# ----------------------------------------------------------------------------------------
# 2. bit-exactness
# ----------------------------------------------------------------------------------------
def host_emulated(x: np.ndarray, degree: int, ftz: bool, coefficients=None,
                  chunk: int = 1 << 20) -> np.ndarray:
    """host_model.exp2_emulated over `x`, chunked across CPU threads."""
    from .host_model import exp2_emulated
    from .minimax import resolve_coefficients

    resolve_coefficients(degree, coefficients)  # fill the cache here: mpmath's precision is
    starts = range(0, len(x), chunk)  # global, so the Remez fit must not run in several threads
    out = np.empty_like(x)
    with cf.ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as ex:
        futs = {ex.submit(exp2_emulated, x[s:s + chunk], degree, coefficients, ftz=ftz): s
                for s in starts}
        for fut in cf.as_completed(futs):
            s = futs[fut]
            out[s:s + chunk] = fut.result()
    return out


def compare_bits(x, cls, y_gpu, y_host, degree, ftz, coefficients=None,
                 max_report: int = 12) -> dict:
    g, h = y_gpu.view(np.uint32), y_host.view(np.uint32)
    bad = np.flatnonzero(g != h)
    both_nan = np.isnan(y_gpu[bad]) & np.isnan(y_host[bad])
    rep = {
        "degree": degree, "ftz": ftz, "n": int(len(x)), "mismatches": int(len(bad)),
        "mismatches_both_nan": int(both_nan.sum()),
        "mismatches_by_class": {c: int((cls[bad] == i).sum()) for i, c in enumerate(CLASSES)},
        "first": [],
    }
    if len(bad):
        from .host_model import exp2_emulated_steps

        idx = bad[:max_report]
        steps = exp2_emulated_steps(x[idx], degree, coefficients, ftz=ftz)
        for k, i in enumerate(idx):
            rep["first"].append({
                "x": float(x[i]), "x_bits": f"0x{x.view(np.uint32)[i]:08X}",
                "class": CLASSES[cls[i]],
                "gpu_bits": f"0x{g[i]:08X}", "host_bits": f"0x{h[i]:08X}",
                "gpu": float(y_gpu[i]), "host": float(y_host[i]),
                "host_steps": {name: f"0x{np.asarray(v).view(np.uint32)[k]:08X}"
                               for name, v in steps.items()},
            })
    return rep


def bitexact_configs() -> list:
    """(degree, ftz, coefficient set name): ours at every degree with and without .ftz, and
    the official FA4 degree-3 coefficients (any float32 coefficients must work)."""
    return ([(d, True, "ours") for d in DEGREES] + [(d, False, "ours") for d in DEGREES]
            + [(3, True, "fa4")])


def check_bitexact(x, cls, configs=None, log=print) -> list:
    import torch

    from .minimax import OFFICIAL_FA4_COEFFICIENTS

    xd = torch.from_numpy(x).cuda()
    reports = []
    for degree, ftz, coeff_set in configs or bitexact_configs():
        coeffs = OFFICIAL_FA4_COEFFICIENTS[degree] if coeff_set == "fa4" else None
        t0 = time.time()
        y_gpu = gk.exp2_gpu(xd, "emulated", degree, coeffs, ftz=ftz).cpu().numpy()
        t1 = time.time()
        y_host = host_emulated(x, degree, ftz, coeffs)
        t2 = time.time()
        rep = compare_bits(x, cls, y_gpu, y_host, degree, ftz, coeffs)
        rep["coefficients"] = coeff_set
        rep["gpu_s"], rep["host_s"] = round(t1 - t0, 2), round(t2 - t1, 2)
        reports.append(rep)
        log(f"  degree {degree} ftz={ftz!s:5s} {coeff_set:4s}: {rep['mismatches']} / {rep['n']}"
            f" mismatches (gpu incl. compile {rep['gpu_s']} s, host {rep['host_s']} s)")
        for m in rep["first"][:5]:
            log(f"    x={m['x']!r} ({m['x_bits']}, {m['class']}): gpu {m['gpu_bits']}"
                f" host {m['host_bits']} steps {m['host_steps']}")
    return reports


# ----------------------------------------------------------------------------------------
# 3. accuracy of MUFU.EX2 (and of the emulation, measured on the device)
# ----------------------------------------------------------------------------------------
def _accuracy_inputs(n: int, seed: int) -> np.ndarray:
    try:
        from .accuracy import accuracy_inputs

        return np.asarray(accuracy_inputs(n, seed), dtype=np.float32)
    except ImportError:  # the CPU half not there yet: same recipe the paper states
        return np.random.default_rng(seed).random(n, dtype=np.float32)


def rel_errors(y32: np.ndarray, x: np.ndarray) -> dict:
    """max / mean relative error vs float64 2^x, for fp32 outputs and after bf16 rounding."""
    import torch

    ref = np.exp2(x.astype(np.float64))
    bf = torch.from_numpy(np.ascontiguousarray(y32)).to(torch.bfloat16).to(torch.float64).numpy()
    e32 = np.abs(y32.astype(np.float64) / ref - 1)
    e16 = np.abs(bf / ref - 1)
    return {"fp32_max": float(e32.max()), "fp32_mean": float(e32.mean()),
            "bf16_max": float(e16.max()), "bf16_mean": float(e16.mean())}


def measure_accuracy(n: int = 4_000_000, seed: int = 0, log=print) -> dict:
    import torch

    x = _accuracy_inputs(n, seed)
    xd = torch.from_numpy(x).cuda()
    gpu_name = torch.cuda.get_device_name().replace("NVIDIA ", "")
    outputs = {"MUFU.EX2 (measured)": gk.exp2_gpu(xd, "mufu").cpu().numpy()}
    for d in DEGREES:
        outputs[f"degree {d} (measured on GPU)"] = gk.exp2_gpu(xd, "emulated", d).cpu().numpy()
    rows = {name: rel_errors(y, x) for name, y in outputs.items()}
    doc = {"n": n, "seed": seed, "input_range": [float(x.min()), float(x.max())], "rows": rows,
           "paper_mufu": {"fp32_max": 1.41e-7, "fp32_mean": 3.04e-8,
                          "bf16_max": 3.89e-3, "bf16_mean": 1.41e-3}}
    try:  # the CPU half's table, with the measured MUFU row added (a bonus, never a failure)
        from .accuracy import accuracy_numbers, accuracy_table

        extra = {f"Hardware MUFU.EX2 ({gpu_name}, measured)": outputs["MUFU.EX2 (measured)"]}
        doc["table_numbers"] = accuracy_numbers(n, seed, extra_rows=extra)
        doc["table"] = accuracy_table(n, seed, extra_rows=extra)
    except Exception as exc:
        doc["table_error"] = f"{type(exc).__name__}: {exc}"
    for name, r in rows.items():
        log(f"  {name:28s} fp32 max {r['fp32_max']:.3e} mean {r['fp32_mean']:.3e} | "
            f"bf16 max {r['bf16_max']:.3e} mean {r['bf16_mean']:.3e}")
    return doc


# ----------------------------------------------------------------------------------------
# 4. the entry point
# ----------------------------------------------------------------------------------------
def _dump(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, default=str)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="stage 2 on the GPU: bit-exactness, MUFU "
                                             "accuracy, exp2 throughput")
    ap.add_argument("--out", required=True, help="directory for the JSON results")
    ap.add_argument("--scale", type=float, default=1.0, help="input count scale (1 = 16M+)")
    ap.add_argument("--bench-iters", type=int, default=16384)
    ap.add_argument("--skip-bench", action="store_true")
    args = ap.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check here (compile-only: python -m "
              "stage2_emulated_exp.gpu_kernel)")
        return 2
    os.makedirs(args.out, exist_ok=True)
    t_start = time.time()
    summary = []

    def log(msg=""):
        print(msg, flush=True)
        summary.append(msg)

    from . import gpu_bench

    env = gpu_bench.environment()
    _dump(os.path.join(args.out, "environment.json"), env)
    log(f"# stage 2 on {env['device']} (arch {gk.ARCH}, torch {env['torch']}, "
        f"cutlass-dsl {env['cutlass_dsl']})")

    # 1. bit-exactness
    x, cls = bitexact_inputs(args.scale)
    log(f"\n## 1. GPU emulation vs host model, {len(x):,} inputs "
        f"({int((cls == 0).sum()):,} structured)")
    status = 0
    try:
        reports = check_bitexact(x, cls, log=log)
        _dump(os.path.join(args.out, "bitexact.json"), reports)
        total_bad = sum(r["mismatches"] for r in reports)
        log(f"  -> {'PASS' if total_bad == 0 else 'FAIL'}: {total_bad} mismatching results")
        status |= int(total_bad != 0)
    except Exception:
        log("  bit-exactness check crashed:\n" + traceback.format_exc())
        status |= 1
    del x, cls

    # 2. accuracy
    log("\n## 2. accuracy on accuracy_inputs(4_000_000, 0) vs float64 "
        "(paper MUFU: 1.41e-7 max / 3.04e-8 mean)")
    try:
        acc = measure_accuracy(log=log)
        _dump(os.path.join(args.out, "accuracy.json"), acc)
        mufu_max = acc["rows"]["MUFU.EX2 (measured)"]["fp32_max"]
        log(f"  -> MUFU max rel err {mufu_max:.3e} ({'ok' if mufu_max < 2e-7 else 'ABOVE 2e-7'})")
        if "table" in acc:
            log("\n" + acc["table"])
    except Exception:
        log("  accuracy measurement crashed:\n" + traceback.format_exc())
        status |= 4

    # 3. throughput
    if not args.skip_bench:
        log("\n## 3. exp2 throughput (results / clk / SM), softmax FFMA + FADD included")
        try:
            bench = gpu_bench.run_bench(n_iter=args.bench_iters, log=log)
            _dump(os.path.join(args.out, "bench.json"), gpu_bench.bench_document(env, bench))
            log("\n" + gpu_bench.summarize(bench["results"]))
        except Exception:
            log("  benchmark crashed:\n" + traceback.format_exc())
            status |= 8

    # 4. the machine code we ran, for the record (cubins always; SASS if nvdisasm is here)
    try:
        rep = gk.compile_only(gk.ARCH, degrees=DEGREES, disassemble=False)
        for name, r in rep.items():
            stem = os.path.join(args.out, f"exp2_{name}.{gk.ARCH}")
            with open(stem + ".cubin", "wb") as f:
                f.write(r["cubin"])
            with open(stem + ".ptx", "w") as f:
                f.write(r["ptx"])
            try:
                with open(stem + ".sass", "w") as f:
                    f.write(gk.sass_from_cubin(r["cubin"]))
            except Exception as exc:
                log(f"  no SASS for {name} ({exc}); the .cubin is saved")
    except Exception:
        log("  machine-code dump failed (not fatal):\n" + traceback.format_exc())

    log(f"\ntotal {time.time() - t_start:.0f} s, exit status {status}")
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write("\n".join(summary) + "\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
