"""Tile sweep for the production Hopper forward (stage 3 step 4): TFLOP/s per (tile_n, stages,
tile_m), next to the official FA4 in the same process, and each variant's max |diff| to FA4's output.

    python benchmarks/tune_fwd.py --out tune.json [--configs 128:176:2,128:128:3,64:128:4:192] [--seqlens 4096,16384]

A config is head_dim:tile_n:num_stages[:tile_m[:lean_mask]] (dv = head_dim, except 192 -> dv 128;
tile_m 128 or 192, default 128 -- 192 = three consumer warpgroups, d = 64 only; lean_mask 1 / 0 =
the lean / old mask of the masked key blocks, absent = the kernel's default for that tile_m, so
128:128:3:128:0,128:128:3:128:1 times both masks side by side). The defaults a user gets are
`default_tile_n` / `default_num_stages` / `default_tile_m` in the step module; this script is how
they were chosen (the results JSON is committed next to the benchmark runs).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_fwd import flops, timer, write_doc  # noqa: E402


def parse_configs(text: str) -> list[tuple[int, int, int, int, bool | None]]:
    """'64:128:4:192,128:176:2:128:1' -> [(64, 128, 4, 192, None), (128, 176, 2, 128, True)]: tile_m
    defaults to 128, lean_mask to None (the kernel's default)."""
    configs = []
    for c in (c for c in text.split(",") if c):
        fields = [int(x) for x in c.split(":")]
        if len(fields) not in (3, 4, 5) or (len(fields) == 5 and fields[4] not in (0, 1)):
            raise ValueError(f"--configs: expected head_dim:tile_n:num_stages[:tile_m[:lean_mask 0|1]], got {c!r}")
        d, tn, st, tm = (fields + [128])[:4]
        configs.append((d, tn, st, tm, bool(fields[4]) if len(fields) == 5 else None))
    return configs


def variant_name(tile_n, stages, tile_m=128, lean_mask=None) -> str:
    """The result row's impl name; configs without the new fields keep their old names."""
    return (f"step4 tile_n={tile_n} stages={stages}" + ("" if tile_m == 128 else f" tile_m={tile_m}")
            + ("" if lean_mask is None else f" lean_mask={int(lean_mask)}"))


def variant_fn(d, dv, causal, tile_n, stages, tile_m=128, lean_mask=None):
    from cutlass import BFloat16

    from stage3_fwd_kernel import common
    from stage3_fwd_kernel.hopper import forward as step4

    def fn(q, k, v):
        out = torch.empty(q.shape[:3] + (dv,), device=q.device, dtype=q.dtype)
        lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], device=q.device, dtype=torch.float32)
        args = step4._call_args(q, k, v, out, lse, d ** -0.5, q.shape[1])
        lean = step4._check_lean_mask(lean_mask, tile_m)  # resolved: a default shares its kernel
        comp = common.compile_cached(
            ("tune", d, dv, causal, tile_n, stages, tile_m, lean),
            lambda: (step4.FlashAttentionForwardSm90Step4(BFloat16, d, dv, causal, tile_n=tile_n,
                                                          num_stages=stages, tile_m=tile_m, lean_mask=lean),
                     step4._fake_args(BFloat16, d, dv, (False, False, False), launchable=True)))
        comp.fn(*args)
        return out
    return fn


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--configs", default="128:128:3,128:176:2,128:160:2")
    ap.add_argument("--seqlens", default="4096,16384")
    ap.add_argument("--causal", default="0,1", help="causal settings to sweep, e.g. '0' or '0,1'")
    args = ap.parse_args(argv)
    configs = parse_configs(args.configs)
    if not torch.cuda.is_available():
        print("tune_fwd needs a CUDA GPU")
        return 2
    from flash_attn.cute.interface import flash_attn_func

    bench, method = timer()
    rows = []
    for d in sorted({c[0] for c in configs}):
        dv = 128 if d == 192 else d
        for causal in (bool(int(c)) for c in args.causal.split(",")):
            for s in (int(x) for x in args.seqlens.split(",")):
                b, h = 32768 // s, 2048 // d
                q, k = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
                v = torch.randn(b, s, h, dv, device="cuda", dtype=torch.bfloat16)
                ref = flash_attn_func(q, k, v, causal=causal)
                ref = ref[0] if isinstance(ref, tuple) else ref
                impls = {"flash-attn-4 (official)": lambda: flash_attn_func(q, k, v, causal=causal)}
                for (cd, tn, st, tm, lean) in configs:
                    if cd == d:
                        impls[variant_name(tn, st, tm, lean)] = (lambda f: lambda: f(q, k, v))(
                            variant_fn(d, dv, causal, tn, st, tm, lean))
                for name, fn in impls.items():
                    row = {"impl": name, "head_dim": d, "head_dim_v": dv, "causal": causal, "seqlen": s}
                    try:
                        out = fn()
                        out = out[0] if isinstance(out, tuple) else out
                        row["max_abs_diff_vs_fa4"] = (out.float() - ref.float()).abs().max().item()
                        ms = bench(fn)
                        row.update(ms=ms, tflops=flops(b, h, s, d, dv, causal) / ms / 1e9)
                    except Exception as exc:  # a config that does not fit is reported, not fatal
                        row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                    rows.append(row)
                    shown = f"{row['tflops']:7.1f}" if "tflops" in row else row["error"][:70]
                    print(f"d={d} causal={causal!s:5} s={s:5} {name:44} {shown}  "
                          f"diff={row.get('max_abs_diff_vs_fa4', float('nan')):.2e}", flush=True)
    write_doc(args.out, "tune_fwd.py", argv, rows, timing=method)
    return 0


if __name__ == "__main__":
    sys.exit(main())
