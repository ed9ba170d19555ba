"""Timelines from inside the forward kernels: the production forward against the official FA4, same shape.

    python -m benchmarks.inspect.trace_fwd --dim 192 --dim_v 128 --causal --seqlen 8192 --batch 4 --heads 10 \
        --out trace.json --plot trace.png [--events all] [--impls ours,official] [--window 1024]

Both kernels are compiled with the same clock stamps (``stage3_fwd_kernel.trace``): per CTA the SM,
``%globaltimer`` and ``clock64`` at the kernel's entry and at the consumers' start and end; with
``--events`` also per key block (top of the step, turn taken, S and P V issued, S landed, softmax
done, P V landed, end). The official kernel gets the same stamps at the same places of its source,
patched in at run time from the installed package (nothing of it is copied here).

What it prints per kernel:
* time per call (``benchmarks.ab_fwd.time_ms``, traced build), CTAs, SMs;
* per SM: busy time, idle time at the end (the tail), gaps between CTAs, split at the next CTA's
  entry (launch) and its consumers' start (prologue: barriers, tile order, setmaxnreg);
* CTA cycles: causal with equal 128-row and 128-key tiles, a fit ``cycles = fixed + per_block x
  blocks`` over the CTAs sorted by length (tile m visits m + 1 blocks); otherwise the median;
  ``--window LEFT`` (causal, window (LEFT, 0), every key block a tile walks: pass the same
  ``--seqlen``'s non-causal run's per-block cycles to split its time into blocks and the rest) the
  median over the tiles that walk the most blocks, and that count;
* with ``--events``: the median cycles between consecutive events in the steady state.

``ours:<module>`` traces an untracked copy of the production forward instead (its own ``STEP``, as
``benchmarks.ab_fwd`` times them): per-CTA cycles of two builds in one call differ by well under 1%
run to run, a finer measure of a hot-loop change than paired rounds. ``ours`` is the production
forward (``stage3_fwd_kernel.hopper``) with one CTA per tile (a persistent CTA would overwrite its
records) and fa4's tile order for the call (LPT for long causal calls). The stamps cost little outside the hot loop,
but per-block stamps move ptxas's schedule (see the trace module): compare like with like.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import os
import sys
import tempfile
import textwrap

import numpy as np

PRODUCTION = "stage3_fwd_kernel.hopper"

# where the official kernel gets each stamp: (its source line, the call to put after it; "before" puts it ahead)
OFFICIAL_BLOCK_STAMPS = [
    ("pipeline_k.consumer_wait(smem_pipe_read, pipeline_k.consumer_try_wait(smem_pipe_read))\n", "top", "before"),
    ("self.warp_scheduler_barrier_sync()\n", "turn", "after"),
    ("self.warp_scheduler_barrier_arrive()\n", "issued", "after"),
    ("warpgroup.wait_group(1)\n", "s_landed", "after"),
    ("row_scale = softmax.online_softmax(acc_S, check_inf=check_inf)\n", "softmax", "after"),
    ("warpgroup.wait_group(0)\n", "pv_landed", "after"),
    ("return smem_pipe_read\n", "end", "before"),
]


def _insert(src: str, anchor: str, call: str, where: str) -> str:
    """Put `call` on its own line before / after the single line of `src` that ends with `anchor`."""
    lines = src.splitlines(keepends=True)
    hits = [i for i, line in enumerate(lines) if line.strip() == anchor.strip()]
    if len(hits) != 1:
        raise RuntimeError(f"official kernel source changed: expected one line {anchor.strip()!r}, found {len(hits)}")
    i = hits[0]
    indent = lines[i][:len(lines[i]) - len(lines[i].lstrip())]
    lines.insert(i if where == "before" else i + 1, f"{indent}{call}\n")
    return "".join(lines)


def patch_official():
    """The official sm90 forward class with our stamps in three of its methods (its own source,
    read from the installed package and re-compiled as a module of its own)."""
    import flash_attn.cute.flash_fwd_sm90 as off

    cls = off.FlashAttentionForwardSm90
    plan = {
        "kernel": [("warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())\n", '_trace.cta_stamp("entry")',
                    "before")],
        "mma": [("aux_tensors = aux_data.tensors\n", '_trace.cta_stamp("start")', "after")],
        "mma_one_n_block_intrawg_overlap": [(a, f'_trace.stamp(n_block, "{e}")', w) for a, e, w in OFFICIAL_BLOCK_STAMPS],
    }
    patch_methods(off, cls, plan, end_in="mma", name="official_traced")


def patch_methods(module, cls, plan: dict, *, end_in: str, name: str):
    """Replace `plan`'s methods of `cls` (defined in `module`) by their own source with the stamps
    inserted (``_insert``) and an "end" CTA stamp appended to method `end_in`, at the method's own
    indentation, re-compiled as a module of its own named `name`."""
    text = [f"import {module.__name__} as _official\n",
            "globals().update({k: v for k, v in vars(_official).items() if not k.startswith('__')})\n",
            "from stage3_fwd_kernel import trace as _trace\n"]
    for method, stamps in plan.items():
        src = textwrap.dedent(inspect.getsource(getattr(cls, method)))
        for anchor, call, where in stamps:
            src = _insert(src, anchor, call, where)
        if method == end_in:  # the consumers' end: after their tile loop
            src = src.rstrip() + '\n    _trace.cta_stamp("end")\n'
        text.append("\n\n" + src)
    folder = tempfile.mkdtemp(prefix=f"fa4_{name}_")
    path = os.path.join(folder, f"{name}.py")
    with open(path, "w") as f:
        f.write("".join(text))
    # loaded from its file (inspect and the DSL read the methods' source from there), registered by name
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    for method in plan:
        setattr(cls, method, getattr(mod, method))


# ------------------------------------------------------------------------------------------------ analysis
def cta_table(records: np.ndarray) -> dict:
    """(CTAs, 4, RECORD) int64 -> per live CTA: sm, entry / start / end globaltimer (ns) and clocks."""
    from stage3_fwd_kernel import trace

    cta = records[:, :, :len(trace.CTA_EVENTS) * 3].reshape(len(records), 4, len(trace.CTA_EVENTS), 3)
    end_g = cta[:, :, trace.CTA_EVENTS.index("end"), 1]
    live = np.nonzero((end_g != 0).any(1))[0]
    out = {"cta": live}
    for j, ev in enumerate(trace.CTA_EVENTS):
        g, c = cta[live, :, j, 1].astype(float), cta[live, :, j, 2].astype(float)
        has = g != 0
        pick = np.max if ev in ("walked", "end") else np.min  # the last warpgroup to get there
        out[ev] = np.array([pick(g[i][has[i]]) if has[i].any() else np.nan for i in range(len(live))])
        out[ev + "_clk"] = np.array([pick(c[i][has[i]]) if has[i].any() else np.nan for i in range(len(live))])
    sm = cta[live, :, trace.CTA_EVENTS.index("start"), 0]
    out["sm"] = np.array([row[row != 0][0] if (row != 0).any() else 0 for row in sm])  # SM 0 reads as 0 too
    return out


def sm_timeline(t: dict) -> dict:
    """Per SM (times in us): the span from the first entry, busy time, idle time at the end, and the
    gaps between two CTAs, split at the next one's entry (launch) and its consumers' start (prologue)."""
    start, end, entry = t["start"], t["end"], t["entry"]
    busy, tail, launch, prologue = [], [], [], []
    for s in np.unique(t["sm"]):
        i = np.nonzero(t["sm"] == s)[0]
        i = i[np.argsort(start[i])]
        busy.append(np.sum(end[i] - start[i]))
        tail.append(np.nanmax(end) - end[i].max())
        launch.extend(entry[i][1:] - end[i][:-1])
        prologue.extend(start[i][1:] - entry[i][1:])
    return {"ctas": int(len(start)), "sms": int(len(np.unique(t["sm"]))),
            "span_us": float((np.nanmax(end) - np.nanmin(entry)) / 1e3),
            "busy_us_per_sm": float(np.mean(busy) / 1e3), "idle_at_end_us_mean": float(np.mean(tail) / 1e3),
            "idle_at_end_us_max": float(np.max(tail) / 1e3),
            "gap_launch_us_median": float(np.median(launch) / 1e3) if launch else None,
            "gap_prologue_us_median": float(np.median(prologue) / 1e3) if prologue else None,
            # entry -> consumers' start on the SM's own clock: the globaltimer above ticks in 0.256 us steps
            "prologue_cycles_median": float(np.nanmedian(t["start_clk"] - t["entry_clk"]))}


def window_blocks(m_block: int, seqlen: int, tile_m: int, tile_n: int, left: int) -> int:
    """Key blocks a causal tile walks under window (left, 0) with equal query and key lengths: the
    causal walk (stage5_scheduling.orders) less the blocks left of its first row's left edge."""
    from stage5_scheduling.orders import kv_blocks_visited

    causal = int(kv_blocks_visited(m_block, seqlen, seqlen, tile_m, tile_n, True))
    return causal - max(m_block * tile_m - left, 0) // tile_n


def summarize(t: dict, causal: bool, seqlen: int, tile_m: int, tile_n: int, window: int | None = None) -> dict:
    """The per-SM and per-CTA numbers of the module docstring (times in us, cycles as counted)."""
    cycles = t["end_clk"] - t["start_clk"]
    res = {**sm_timeline(t), "cta_cycles_median": float(np.median(cycles))}
    n_blocks = -(-seqlen // tile_n)
    if window is not None:
        walks = [window_blocks(m, seqlen, tile_m, tile_n, window) for m in range(-(-seqlen // tile_m))]
        most = max(walks)
        # CTAs in order of their cycles; the share of tiles with the longest walk are the longest CTAs
        longest = np.sort(cycles)[-max(1, len(cycles) * walks.count(most) // len(walks)):]
        res.update(window_blocks_walked=most, window_cta_cycles_median=float(np.median(longest)))
    elif causal and tile_m == tile_n and seqlen % tile_m == 0:
        srt = np.sort(cycles)
        per = len(srt) // n_blocks
        med = np.array([np.median(srt[k * per:(k + 1) * per]) for k in range(n_blocks)])
        fixed, per_block = np.linalg.lstsq(np.vstack([np.ones(n_blocks), np.arange(1, n_blocks + 1)]).T, med,
                                           rcond=None)[0]
        res.update(cycles_fixed=float(fixed), cycles_per_block=float(per_block))
    elif not causal:
        res.update(cycles_per_block_incl_fixed=float(np.median(cycles) / n_blocks))
    return res


def block_clocks(records: np.ndarray, events: tuple) -> np.ndarray:
    """(CTAs, 4, RECORD) records -> their per-block stamps (CTAs, warpgroups, blocks, events) of `events`
    (0 where a warpgroup did not stamp)."""
    from stage3_fwd_kernel import trace

    base = len(trace.CTA_EVENTS) * 3
    blk = records[:, :, base:].reshape(len(records), 4, trace.MAX_BLOCKS, trace.NUM_EVENTS)
    return blk[..., [trace.EVENTS.index(e) for e in events]].astype(np.int64)


def block_events(records: np.ndarray, events: tuple) -> dict:
    """Median cycles between consecutive stamped events, steady state (the first two and last two
    blocks a warpgroup walks are left out), and the period from one block's first event to the next."""
    from stage3_fwd_kernel import trace

    x = block_clocks(records, events)                                   # (cta, wg, block, event)
    ok = (x != 0).all(-1)
    diffs, periods = [], []
    for c in range(x.shape[0]):
        for w in range(4):
            walked = np.nonzero(ok[c, w])[0][::-1][2:-2]   # walked last block first
            walked = walked[walked < trace.MAX_BLOCKS - 1]
            for n in walked:
                diffs.append(np.diff(x[c, w, n]))
                if n >= 1 and ok[c, w, n - 1]:
                    periods.append(x[c, w, n - 1, 0] - x[c, w, n, 0])
    out = {}
    if diffs:
        d = np.median(np.array(diffs), axis=0)
        out = {f"{a}->{b}": float(v) for a, b, v in zip(events[:-1], events[1:], d)}
    if periods:
        out["period"] = float(np.median(periods))
    return out


# ------------------------------------------------------------------------------------------------ run
def run_impl(name: str, args, events: tuple):
    import torch

    from stage3_fwd_kernel import trace

    d, dv = args.dim, args.dim_v or args.dim
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k = (torch.randn(args.batch, args.seqlen, args.heads, d, device="cuda", dtype=torch.bfloat16, generator=gen)
            for _ in range(2))
    v = torch.randn(args.batch, args.seqlen, args.heads, dv, device="cuda", dtype=torch.bfloat16, generator=gen)
    from stage3_fwd_kernel.components.window import Window
    from stage3_fwd_kernel.hopper.config import default_tile_m, default_tile_n

    # our tile with no scheduler given (the official kernel's too, but d = 96 causal: 192 x 128 there)
    window = None if args.window is None else Window(args.window, 0)
    tile_m = default_tile_m(d, dv, args.causal, window, seqlen_k=args.seqlen)
    tile_n = default_tile_n(d, dv, tile_m, plain=window is None)
    kw = {} if args.window is None else {"window_size": (args.window, 0)}
    n_ctas = (-(-args.seqlen // 128)) * args.heads * args.batch  # both kernels' tiles have >= 128 rows
    buf = torch.zeros(trace.buffer_elems(n_ctas), dtype=torch.int64, device="cuda")
    trace.enable(buf.data_ptr(), events)
    try:
        if name.startswith("ours"):
            from fa4._dispatch import causal_forward_scheduler
            ours = importlib.import_module(name.partition(":")[2] or PRODUCTION)

            # fa4's order for the call: LPT for long causal calls, none under a window (its tiles are equal)
            sched = causal_forward_scheduler("sm_90", args.causal and window is None, args.seqlen, d, dv, args.heads,
                                             args.heads)

            def call():
                return ours.attention_forward(q, k, v, causal=args.causal, persistent=False, scheduler=sched, **kw)
        else:
            patch_official()
            from flash_attn.cute.interface import flash_attn_func

            def call():
                return flash_attn_func(q, k, v, causal=args.causal, **kw)
        ms = time_then_trace(call, buf)
    finally:
        trace.disable()
    records = buf.view(n_ctas, 4, trace.RECORD).cpu().numpy()
    return ms, records, tile_m, tile_n


def time_then_trace(call, buf) -> float:
    """Compile and time `call` (ab_fwd.time_ms: ms per call), then run it once more with the trace
    buffer zeroed first, so the records are that one call's."""
    import torch

    from ..ab_fwd import time_ms

    call()  # compiles
    ms = time_ms(call)
    buf.zero_()
    call()
    torch.cuda.synchronize()
    return ms


def plot_timelines(tables: dict, path: str, sms: int = 24):
    """One panel per kernel: the first `sms` SMs, each CTA a bar from its consumers' start to end
    (grey before it: launch and prologue); the tail is the white space at the right."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t_end = max(np.nanmax(t["end"]) - np.nanmin(t["entry"]) for t in tables.values()) / 1e3
    fig, axes = plt.subplots(len(tables), 1, figsize=(11, 1.2 + 0.16 * sms * len(tables)), sharex=True, squeeze=False)
    for ax, (name, t) in zip(axes[:, 0], tables.items()):
        t0 = np.nanmin(t["entry"])
        for row, s in enumerate(np.unique(t["sm"])[:sms]):
            i = np.nonzero(t["sm"] == s)[0]
            ax.broken_barh([((t["entry"][j] - t0) / 1e3, (t["start"][j] - t["entry"][j]) / 1e3) for j in i], (row, 0.8),
                           facecolors="0.6")
            ax.broken_barh([((t["start"][j] - t0) / 1e3, (t["end"][j] - t["start"][j]) / 1e3) for j in i], (row, 0.8),
                           facecolors=["C0" if k % 2 else "C1" for k in range(len(i))])
        ax.set_ylabel(f"{name}\nSM", fontsize=9)
        ax.set_yticks([])
        ax.set_xlim(0, t_end * 1.01)
    axes[-1, 0].set_xlabel("us since the first CTA's entry (grey: launch + prologue; colours alternate per CTA)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--dim_v", type=int, default=None)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--impls", default="ours,official",
                    help="ours, official, and ours:<module> for an untracked copy of the production forward")
    ap.add_argument("--events", default="", help="per-block events: 'all', or names from trace.EVENTS, comma-separated")
    ap.add_argument("--window", type=int, default=None, metavar="LEFT",
                    help="causal with window_size (LEFT, 0) (needs --causal)")
    ap.add_argument("--out", default=None, help="results JSON")
    ap.add_argument("--plot", default=None, help="per-SM timeline PNG")
    args = ap.parse_args(argv)
    if args.window is not None and (args.window < 0 or not args.causal):
        raise SystemExit(f"--window: a left window of >= 0 keys with --causal, got {args.window} "
                         f"({'causal' if args.causal else 'not causal'})")
    impls = [x for x in args.impls.split(",") if x]
    if any(x != "official" and x.partition(":")[0] != "ours" for x in impls):
        raise SystemExit(f"--impls: expected ours, ours:<module> (a copy) and/or official, got {args.impls!r}")
    import torch

    if not torch.cuda.is_available():
        print("trace_fwd needs a CUDA GPU", file=sys.stderr)
        return 2
    from stage3_fwd_kernel import trace

    events = trace.EVENTS if args.events == "all" else tuple(e for e in args.events.split(",") if e)
    rows, tables = [], {}
    for name in impls:
        print(f"{name}: compiling the traced build and running ...", flush=True)
        ms, records, tile_m, tile_n = run_impl(name, args, events)
        t = cta_table(records)
        if not len(t["cta"]):  # a kernel without stage3_fwd_kernel.trace's stamps (e.g. a lesson)
            rows.append({"impl": name, "error": "no CTA recorded an end stamp: this kernel has no trace stamps"})
            print(f"{name}: {rows[-1]['error']}")
            continue
        tables[name] = t
        row = {"impl": name, "ms_per_call_traced": ms,
               **summarize(t, args.causal, args.seqlen, tile_m, tile_n, args.window)}
        if events:
            row["block_events_median_cycles"] = block_events(records, events)
        rows.append(row)
        print(f"{name}: {ms:.3f} ms/call, {row['ctas']} CTAs on {row['sms']} SMs; per SM busy "
              f"{row['busy_us_per_sm']:.1f} us, idle at the end {row['idle_at_end_us_mean']:.1f} us "
              f"(max {row['idle_at_end_us_max']:.1f}); between CTAs: launch {row['gap_launch_us_median']:.2f} us, "
              f"prologue {row['gap_prologue_us_median']:.2f} us")
        print(f"  prologue (entry -> consumers' start) {row['prologue_cycles_median']:.0f} cycles (median)")
        if "window_blocks_walked" in row:
            print(f"  CTA cycles, median of the tiles walking {row['window_blocks_walked']} key blocks: "
                  f"{row['window_cta_cycles_median']:.0f}")
        elif "cycles_per_block" in row:
            print(f"  CTA cycles = {row['cycles_fixed']:.0f} + {row['cycles_per_block']:.0f} x key blocks")
        else:
            print(f"  CTA cycles, median {row['cta_cycles_median']:.0f}")
        if events:
            print("  per block (median cycles):", ", ".join(f"{k} {v:.0f}" for k, v in row["block_events_median_cycles"].items()))
    if args.out:
        from ..bench_fwd import write_doc

        write_doc(args.out, "benchmarks.inspect.trace_fwd", argv, rows, shape=dict(dim=args.dim, dim_v=args.dim_v or args.dim,
                  causal=args.causal, seqlen=args.seqlen, batch=args.batch, heads=args.heads, window=args.window),
                  events=list(events))
    if args.plot and tables:
        plot_timelines(tables, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
