"""Timelines from inside the backward main kernels: the production backward against the official FA4.

    python -m benchmarks.inspect.trace_bwd --dim 128 --causal --seqlen 4096 --batch 8 --heads 16 \
        --out trace.json --plot trace.png [--impls ours,official,step3_rs,step3_rs@64x128]

Both main kernels get the clock stamps of ``stage3_fwd_kernel.trace``: per CTA (one K/V tile each, in
both kernels) the SM, ``%globaltimer`` and ``clock64`` at the kernel's entry, at its consumers'
start, at the end of their walk and after dK / dV are stored, and the number of Q tiles the CTA
walks (``trace.note``). Besides ``ours`` (the production backward with its defaults) and ``official``,
an ``--impls`` entry may be any ``benchmarks.ab_bwd`` variant: CTA cycles of two builds in one call repeat
within a few tenths of a percent, a finer measure of a change than paired rounds.
The official kernel gets them at the same places of its source, patched in at run time from the
installed package (nothing of it is copied here). The preprocess and postprocess are not traced.

What it prints per kernel:
* time per call of the whole backward (``benchmarks.ab_fwd.time_ms``, traced build), CTAs, SMs;
* per SM: busy time, idle time at the end (the tail), gaps between CTAs (launch, prologue);
* CTA cycles against walk length: a least-squares fit ``cycles = fixed + per_tile x Q tiles`` over
  the medians of the CTAs that walk the same number of tiles, and ``per_tile / tile_m``, the cycles
  per query row, which compares kernels with different tiles (ours 80 x 128 at d = 128, the
  official 64 x 128 causal, 80 x 128 non-causal);
* the same fit from the start to the end of the walk, and the epilogue's cycles (walk end -> dK / dV
  stored): where a CTA's fixed cost sits;
* the sum of all CTAs' cycles (the work, whatever the order) and the makespan (work plus tail).
"""
from __future__ import annotations

import argparse
import importlib
import sys

import numpy as np

from ..ab_bwd import parse_window, variant_call
from .trace_fwd import block_clocks, cta_table, patch_methods, plot_timelines, sm_timeline, time_then_trace


# where the official kernel gets each stamp: method -> (its source line, the call, before / after that line)
OFFICIAL_STAMPS = {
    "kernel": [("warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())\n", '_trace.cta_stamp("entry")',
                "before")],
    "mma": [("tile_scheduler = TileSchedulerCls()\n", '_trace.cta_stamp("start")', "before"),
            ("m_block_min, m_block_max = block_info.get_m_block_min_max(seqlen, n_block)\n",
             "_trace.note(m_block_max - m_block_min)", "after"),
            ("if const_expr(self.qhead_per_kvhead == 1):\n", '_trace.cta_stamp("walked")', "before")],
}


# --tile-stamps: the end of each Q tile of the walk (per-block slot = the tile's index in the walk)
OFFICIAL_TILE_STAMP = ("dKV_accumulate = True\n", '_trace.stamp(m_block - m_block_min, "end")', "after")


def patch_official(tile_stamps: bool = False):
    """The official sm90 backward class with our stamps in its kernel entry and its consumers' method."""
    import flash_attn.cute.flash_bwd_sm90 as off

    plan = {k: list(v) for k, v in OFFICIAL_STAMPS.items()}
    if tile_stamps:
        plan["mma"].append(OFFICIAL_TILE_STAMP)
    patch_methods(off, off.FlashAttentionBackwardSm90, plan, end_in="mma",
                  name="official_bwd_traced" + "_tiles" * tile_stamps)


def walk_fit(cycles: np.ndarray, tiles: np.ndarray) -> dict:
    """cycles = fixed + per_tile x tiles, fitted to the median CTA of each walk length."""
    lengths = np.unique(tiles[tiles > 0])
    med = np.array([np.median(cycles[tiles == n]) for n in lengths])
    if len(lengths) < 2:
        return {"walk_tiles": int(lengths[0]) if len(lengths) else 0,
                "cycles_per_tile_incl_fixed": float(med[0] / lengths[0]) if len(lengths) else None}
    fixed, per_tile = np.linalg.lstsq(np.vstack([np.ones(len(lengths)), lengths]).T, med, rcond=None)[0]
    return {"cycles_fixed": float(fixed), "cycles_per_tile": float(per_tile),
            "walk_tiles_min": int(lengths[0]), "walk_tiles_max": int(lengths[-1])}


def tile_split(tile_end: np.ndarray, t: dict) -> dict:
    """--tile-stamps: medians over the CTAs that walk 3 .. 126 tiles of the first tile (consumers' start ->
    its end: the loads' latency and the first, masked, tile), the tiles after it (per tile), and the
    last tile's end -> end of the walk. tile_end: (CTAs, slots) clocks, the last warpgroup's."""
    n = t["note"].astype(int)
    # tiles from the record's last slot on share it (stage3_fwd_kernel.trace.MAX_BLOCKS): longer walks are left out
    rows = np.nonzero((n >= 3) & (n < tile_end.shape[1]))[0]
    if not len(rows):
        return {}
    first = [tile_end[i, 0] - t["start_clk"][i] for i in rows]
    rest = [(tile_end[i, n[i] - 1] - tile_end[i, 0]) / (n[i] - 1) for i in rows]
    tail = [t["walked_clk"][i] - tile_end[i, n[i] - 1] for i in rows]
    return {"first_tile_cycles_median": float(np.median(first)), "later_tile_cycles_median": float(np.median(rest)),
            "last_tile_to_walked_cycles_median": float(np.median(tail))}


def summarize(t: dict, tile_m: int) -> dict:
    """trace_fwd's per-SM timeline, the walk fits and the sums of the module docstring."""
    cycles = t["end_clk"] - t["start_clk"]
    res = {**sm_timeline(t), "tile_m": tile_m, "cta_cycles_sum": float(np.nansum(cycles)),
           "q_tiles_sum": int(np.sum(t["note"])), **walk_fit(cycles, t["note"])}
    if "cycles_per_tile" in res:
        res["cycles_per_query_row"] = res["cycles_per_tile"] / tile_m
    walked = t["walked_clk"]
    if np.isfinite(walked).any():  # split the CTA: start -> end of the walk (fit again), walk -> end (epilogue)
        walk = walk_fit(walked - t["start_clk"], t["note"])
        res.update({f"walk_{k}": v for k, v in walk.items() if k.startswith("cycles")},
                   epilogue_cycles_median=float(np.nanmedian(t["end_clk"] - walked)))
    return res


def variant_tile_m(spec: str, d: int, causal: bool, deterministic: bool) -> int:
    """The query tile rows of a benchmarks.ab_bwd variant: its @MxN override, else its kernel's default
    (the production module answers through step_for, the module that serves the call)."""
    from ..bench_bwd import STEPS

    kernel, _, tiles = spec.split("~")[0].split(":")[0].removesuffix("+det").partition("@")
    if tiles:
        return int(tiles.split("x")[0])
    mod = importlib.import_module(STEPS.get(kernel, kernel))
    if hasattr(mod, "step_for"):
        mod = mod.step_for(d, causal, deterministic)
    return mod.default_tiles(d, d)[0]


def run_impl(name: str, args):
    import torch

    from stage3_fwd_kernel import trace
    from stage3_fwd_kernel.hopper import attention_forward

    d = args.dim
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(args.batch, args.seqlen, args.heads, d, device="cuda", dtype=torch.bfloat16,
                               generator=gen) for _ in range(4))
    window = variant_call(args.window)
    n_ctas = (-(-args.seqlen // 64)) * args.heads * args.batch  # both kernels' K/V tiles have >= 64 rows
    buf = torch.zeros(trace.buffer_elems(n_ctas), dtype=torch.int64, device="cuda")
    trace.enable(buf.data_ptr(), events=("end",) if args.tile_stamps else ())
    try:
        if name != "official":
            from ..ab_bwd import make_variant

            out, lse = attention_forward(q, k, v, causal=args.causal, **window)
            spec = "production" if name == "ours" else name  # a benchmarks.ab_bwd variant, e.g. step3_rs@64x128
            variant = make_variant(spec + ("+det" if args.deterministic and not spec.endswith("+det") else ""))
            tile_m = variant_tile_m(spec, d, args.causal, args.deterministic)

            def call():
                return variant(q, k, v, out, do, lse, args.causal, **window)
        else:
            patch_official(args.tile_stamps)
            from flash_attn.cute.interface import _tile_size_bwd_sm90, flash_attn_func

            qg, kg, vg = (x.detach().clone().requires_grad_() for x in (q, k, v))
            o = flash_attn_func(qg, kg, vg, causal=args.causal, deterministic=args.deterministic, **window)
            o = o[0] if isinstance(o, tuple) else o
            tile_m = _tile_size_bwd_sm90(d, d, args.causal, bool(window)).m_block_size

            def call():
                return torch.autograd.grad(o, (qg, kg, vg), do, retain_graph=True)
        ms = time_then_trace(call, buf)
    finally:
        trace.disable()
    records = buf.view(n_ctas, 4, trace.RECORD).cpu().numpy()
    return ms, records, tile_m


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dim", type=int, default=128, choices=(64, 96, 128))
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--window", default=None, metavar="LEFT[,RIGHT]",
                    help="sliding window of both kernels: (LEFT, RIGHT), RIGHT defaulting to 0 with --causal, "
                         "else LEFT")
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--impls", default="ours,official",
                    help="ours, official, or benchmarks.ab_bwd variants (e.g. step3_rs@64x128), comma-separated")
    ap.add_argument("--out", default=None, help="results JSON")
    ap.add_argument("--plot", default=None, help="per-SM timeline PNG")
    ap.add_argument("--tile-stamps", action="store_true",
                    help="also stamp the end of every Q tile (changes both kernels' schedules a little): splits "
                         "a CTA's walk into its first tile, the later ones and the last tile's tail")
    args = ap.parse_args(argv)
    args.window = parse_window(args.window, args.causal)
    impls = [x for x in args.impls.split(",") if x]
    if not impls:
        raise SystemExit(f"--impls: expected ours, official and / or benchmarks.ab_bwd variants, got {args.impls!r}")
    import torch

    if not torch.cuda.is_available():
        print("trace_bwd needs a CUDA GPU", file=sys.stderr)
        return 2
    from stage3_fwd_kernel import trace

    rows, tables = [], {}
    for name in impls:
        print(f"{name}: compiling the traced build and running ...", flush=True)
        ms, records, tile_m = run_impl(name, args)
        t = cta_table(records)
        if not len(t["cta"]):  # a kernel without stage3_fwd_kernel.trace's stamps (e.g. a lesson)
            rows.append({"impl": name, "error": "no CTA recorded an end stamp: this kernel has no trace stamps"})
            print(f"{name}: {rows[-1]['error']}")
            continue
        t["note"] = records[t["cta"], :, trace.NOTE].max(1)
        tables[name] = t
        row = {"impl": name, "ms_per_call_traced": ms, **summarize(t, tile_m)}
        if args.tile_stamps:
            ends = block_clocks(records[t["cta"]], ("end",))[..., 0].max(1)  # (CTAs, tiles), the last warpgroup
            row.update(tile_split(ends.astype(float), t))
        rows.append(row)
        print(f"{name}: {ms:.3f} ms/call (whole backward), main kernel {row['span_us']:.1f} us, {row['ctas']} CTAs "
              f"on {row['sms']} SMs; per SM busy {row['busy_us_per_sm']:.1f} us, idle at the end "
              f"{row['idle_at_end_us_mean']:.1f} us (max {row['idle_at_end_us_max']:.1f}); between CTAs: launch "
              f"{row['gap_launch_us_median']:.2f} us, prologue {row['gap_prologue_us_median']:.2f} us")
        if "cycles_per_tile" in row:
            print(f"  CTA cycles = {row['cycles_fixed']:.0f} + {row['cycles_per_tile']:.0f} x Q tiles of {tile_m} rows "
                  f"({row['cycles_per_query_row']:.1f} per query row); all CTAs: {row['cta_cycles_sum'] / 1e9:.3f} G "
                  f"cycles over {row['q_tiles_sum']} Q tiles")
        if "epilogue_cycles_median" in row:
            print(f"  of which: start -> end of the walk = {row.get('walk_cycles_fixed', float('nan')):.0f} + "
                  f"{row.get('walk_cycles_per_tile', float('nan')):.0f} x Q tiles; epilogue (walked -> end) "
                  f"{row['epilogue_cycles_median']:.0f} cycles (median)")
        print(f"  prologue (entry -> consumers' start) {row['prologue_cycles_median']:.0f} cycles (median)")
        if "first_tile_cycles_median" in row:
            print(f"  tile stamps (CTAs of 3 .. 126 tiles, medians): first tile {row['first_tile_cycles_median']:.0f} "
                  f"cycles from the start, later tiles {row['later_tile_cycles_median']:.0f} each, last tile -> end "
                  f"of the walk {row['last_tile_to_walked_cycles_median']:.0f}")
        if "cycles_per_tile" not in row:
            print(f"  CTA cycles per Q tile (fixed cost included) {row['cycles_per_tile_incl_fixed']:.0f}; all CTAs: "
                  f"{row['cta_cycles_sum'] / 1e9:.3f} G cycles over {row['q_tiles_sum']} Q tiles")
    if args.out:
        from ..bench_fwd import write_doc

        write_doc(args.out, "benchmarks.inspect.trace_bwd", argv, rows,
                  shape=dict(dim=args.dim, causal=args.causal, window=args.window, deterministic=args.deterministic,
                             seqlen=args.seqlen, batch=args.batch, heads=args.heads))
    if args.plot and tables:
        plot_timelines(tables, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
